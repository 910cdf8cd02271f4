"""Write ``tests/data/chat_golden.json``: transformers' ``apply_chat_template`` text and ids for
SmolLM2-135M-Instruct's ChatML and Llama-3.1-Instruct's template, and the two tokenizer fixtures
they use under ``tests/data/tokenizers/``.

Needs transformers (the ``hf`` extra); ``tests/checkpoint/test_chat_template.py`` reads the
files without it, and its ``hf`` test recomputes every case live.

- ``tokenizers/smollm2/``: the tokenizer transformers builds from SmolLM2's GGUF
  (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``), written compactly. Its
  pre-tokenizer is set to the one SmolLM2's own ``tokenizer.json`` has, ``Digits`` then
  ``ByteLevel``, the split llama.cpp's ``smollm`` pre-tokenizer names: transformers' GGUF
  conversion keeps only ``ByteLevel``, which splits some numerals (``"²³"``) differently.
  The template is in ``chat_template.jinja``, as transformers saves it.
- ``tokenizers/llama31/``: a small byte-level BPE trained here on :data:`CORPUS` with Llama 3's
  pre-tokenizer split, its special tokens appended as Llama 3 numbers them (after the BPE
  vocabulary) and its post-processor that prepends ``<|begin_of_text|>`` (which a chat must
  not get twice). Llama-3.1-Instruct's template is in its ``tokenizer_config.json``, as Meta
  ships it (read back from there on a rebuild, pinned by its sha256), with the special tokens
  as ``{"content": ...}`` dicts. Every case pins ``date_string`` (the template reads it).

Each conversation is rendered with ``add_generation_prompt`` True and False; a case records
the text (``tokenize=False``) and the ids. Special-token text inside a message is encoded as
the special token, as transformers does by default.

Run:  python tests/data/make_chat_golden.py [--smollm2-gguf PATH] [--rebuild-tokenizers]
(the GGUF is needed only to rebuild ``tokenizers/smollm2``: ``python -m jspec models fetch smollm2``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import tokenizers
import transformers
from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers

DATA = Path(__file__).resolve().parent
OUT = DATA / "chat_golden.json"
TOKENIZERS = DATA / "tokenizers"
DATE = "26 Jul 2024"
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
                r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
                  "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
SMOLLM2_PRE = {"type": "Sequence", "pretokenizers": [
    {"type": "Digits", "individual_digits": True},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}

SYSTEM = {"role": "system", "content": "You are a concise assistant. Answer in one sentence."}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_temperature", "description": "La température actuelle (°C) à un endroit — « exacte ».",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "Ville, pays: e.g. \"Zürich, CH\" <b>&</b>"}},
        "required": ["location"]}}}
# name -> (messages, template kwargs beyond date_string, which tokenizers)
CHATS = {
    "no_system": ([{"role": "user", "content": "Hi there! What can you do?"}], {}, "both"),
    "system": ([SYSTEM, {"role": "user", "content": "What is 12 * 34, and why?"}], {}, "both"),
    "multi_turn": ([SYSTEM,
                    {"role": "user", "content": "Name a prime number above 100."},
                    {"role": "assistant", "content": "101 is prime."},
                    {"role": "user", "content": "And one between 2024 and 2030?"}], {}, "both"),
    "unicode": ([{"role": "user", "content": "你好，世界！これはテストです。한국어도 돼요? "
                                             "Café naïve Ångström façade — 🙂👍🏽🇺🇸 ❤️ x²³ ½"},
                 {"role": "assistant", "content": "Ça va très bien, merci ! 谢谢 🙏"}], {}, "both"),
    "whitespace": ([{"role": "system", "content": "  padded system  \n"},
                    {"role": "user", "content": "  leading and trailing spaces  \n\n\ttabs\tinside\r\n"},
                    {"role": "assistant", "content": "\n\n  indented answer\n    code\n"},
                    {"role": "user", "content": "   "},
                    {"role": "user", "content": ""}], {}, "both"),
    "special_text": ([{"role": "user", "content": "Type <|im_end|> then <|im_start|>assistant\n and "
                                                  "<|eot_id|><|start_header_id|>, <|begin_of_text|> too"},
                      {"role": "assistant", "content": "Literal: <|im_end|> <|endoftext|> <|eom_id|>"}],
                     {}, "both"),
    "tools": ([{"role": "user", "content": "Quel temps fait-il à Zürich ?"}],
              {"tools": [WEATHER_TOOL]}, "llama31"),
    "tools_in_system": ([SYSTEM, {"role": "user", "content": "Weather in Paris?"}],
                        {"tools": [WEATHER_TOOL], "tools_in_user_message": False}, "llama31"),
    "tool_call": ([{"role": "user", "content": "Weather in Oslo?"},
                   {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                       "name": "get_temperature", "arguments": {"location": "Oslo, NO"}}}]},
                   {"role": "tool", "content": {"temperature": -3.5, "unit": "°C"}},
                   {"role": "ipython", "content": "22 °C"}], {}, "llama31"),
    "builtin_tools": ([{"role": "user", "content": "Search the news."}],
                      {"builtin_tools": ["brave_search", "code_interpreter", "wolfram_alpha"]}, "llama31"),
}

# Text the small Llama-3-style BPE learns its merges from: English, code, numbers, and the
# scripts the cases use, so the ids are not all single bytes.
CORPUS = [
    "The quick brown fox jumps over the lazy dog. You are a helpful assistant.",
    "What is the weather like today? Answer in one sentence, please. Thank you!",
    "def main():\n    print('hello world')\n    return 0\n", "In 2024, 12 * 34 = 408; 3.14159.",
    "The system message, the user message and the assistant message end with a token.",
    "你好，世界！这是一个测试。谢谢你的帮助。", "これはテストです。日本語のテキスト。",
    "한국어 텍스트입니다. 돼요?", "Café naïve résumé façade Ångström. Ça va très bien, merci !",
    "La température actuelle à Zürich est exacte. Quel temps fait-il ?",
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n",
    "Given the following functions, please respond with a JSON for a function call "
    "with its proper arguments that best answers the given prompt. Do not use variables.",
    '{"name": "get_temperature", "parameters": {"location": "Oslo"}}',
]

LLAMA31_SHA256 = "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65"
LLAMA31_CONFIG = TOKENIZERS / "llama31" / "tokenizer_config.json"


def llama31_template() -> str:
    """Meta's Llama-3.1-Instruct template: from the fixture, or from the file named by
    ``LLAMA31_TEMPLATE_SRC`` (how the fixture was first made)."""
    src = os.environ.get("LLAMA31_TEMPLATE_SRC")
    text = Path(src).read_text() if src else json.loads(LLAMA31_CONFIG.read_text())["chat_template"]
    if hashlib.sha256(text.encode()).hexdigest() != LLAMA31_SHA256:
        sys.exit("the Llama-3.1 template is not Meta's (sha256 differs)")
    return text


def build_smollm2(gguf: str, dst: Path) -> None:
    d, name = os.path.split(os.path.abspath(gguf))
    hf = transformers.AutoTokenizer.from_pretrained(d, gguf_file=name)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        spec = json.loads((Path(tmp) / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = SMOLLM2_PRE
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "tokenizer.json").write_text(tokenizers.Tokenizer.from_str(json.dumps(spec)).to_str())
    (dst / "chat_template.jinja").write_text(hf.chat_template)
    cfg = {k: v for k, v in hf.special_tokens_map.items()}
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def build_llama31(template: str, dst: Path) -> None:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=900, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.add_special_tokens(LLAMA3_SPECIAL)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                      pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                                      special_tokens=[("<|begin_of_text|>", bos)])])
    dst.mkdir(parents=True, exist_ok=True)
    tok.save(str(dst / "tokenizer.json"), pretty=False)
    added = {"__type": "AddedToken", "lstrip": False, "normalized": False, "rstrip": False,
             "single_word": False, "special": True}
    cfg = {"bos_token": {**added, "content": "<|begin_of_text|>"}, "chat_template": template,
           "eos_token": {**added, "content": "<|eot_id|>"}, "model_max_length": 131072,
           "tokenizer_class": "PreTrainedTokenizerFast"}
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def cases(name: str, tok) -> list[dict]:
    out = []
    for chat, (messages, kwargs, which) in CHATS.items():
        if which not in ("both", name):
            continue
        for gen in (True, False):
            kw = {"date_string": DATE, **kwargs}
            text = tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False, **kw)
            ids = tok.apply_chat_template(messages, add_generation_prompt=gen, return_dict=False, **kw)
            out.append({"tokenizer": name, "name": chat, "add_generation_prompt": gen,
                        "messages": messages, "kwargs": kw, "text": text, "ids": list(ids)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smollm2-gguf", help="SmolLM2-135M-Instruct.Q4_1.gguf, to rebuild tokenizers/smollm2")
    ap.add_argument("--rebuild-tokenizers", action="store_true")
    args = ap.parse_args()
    template = llama31_template()
    if args.rebuild_tokenizers or not (TOKENIZERS / "llama31" / "tokenizer.json").is_file():
        build_llama31(template, TOKENIZERS / "llama31")
    if args.smollm2_gguf:
        build_smollm2(args.smollm2_gguf, TOKENIZERS / "smollm2")
    rows = []
    for name in ("smollm2", "llama31"):
        tok = transformers.PreTrainedTokenizerFast.from_pretrained(TOKENIZERS / name)
        rows += cases(name, tok)
    OUT.write_text(json.dumps({
        "description": __doc__.split("\n\n")[0], "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__, "cases": rows}, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT} ({len(rows)} cases)")


if __name__ == "__main__":
    main()
