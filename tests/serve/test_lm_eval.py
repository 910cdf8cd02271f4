"""lm-evaluation-harness's ``local-completions`` model against ``python -m jspec serve``, offline.

Two tasks from JSON files written here (no hub): a ``generate_until`` task (short code
completions for the shipped model, trained on Python stdlib source; ``exact_match``) and a
``multiple_choice`` task (``acc``, from loglikelihoods: ``echo`` + ``logprobs`` on the server).
lm-eval tokenizes through the server (``tokenizer_backend=remote``: ``/tokenize``,
``/detokenize``, ``/tokenizer_info``) and sends token ids. What it sent is recorded (each
payload, and each loglikelihood request's ids and context length), and every sample's
response and score must equal the same computed in-process on the same ids: greedy
:func:`jspec.generate` with the request's ``max_tokens``, cut at its stop strings, and
:func:`jspec.scoring.teacher_forced` sums (is_greedy: every continuation token the argmax).
"""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")

from helpers import serve_process  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "default"
MAX_GEN = 16

# (prompt, target): the rest of the line; exact_match against the greedy completion. The
# model is small: two targets are its own greedy lines ("lib", '""'), so the score is
# neither 0 nor 1 and a hit and a miss are both checked.
GEN = [("import os\nimport ", "lib"),
       ("#!/usr/bin/env ", "python"),
       ("if __name__ == ", "'__main__':"),
       ("class Error(Exception):\n    ", "pass"),
       ("from __future__ import ", "annotations"),
       ("def __init__(self", "):"),
       ("try:\n    import ", "threading"),
       ("    def __repr__(self):\n        return ", '""')]

# (context, choices, label): the choice is appended to the context as it is (no delimiter).
MC = [("import os\nimport", [" sys", " ((", " ]]"], 0),
      ("def __init__(self", ["):", "!!", " >>= 3"], 0),
      ("if __name__ == '__main__", ["':", "\"\"\""], 0),
      ("for i in range(", ["len(self)):", ")))", "else"], 0),
      ("class Foo(object):\n    def", [" __init__(self):", " 12", " ::", " self"], 0),
      ("    return", [" None", " ;;"], 1),
      ("try:\n    pass\nexcept", [" ImportError:", " import", " =="], 2),
      ("x = [1, 2, 3", ["]", "}", ")", ":"], 3)]


def _write_tasks(d):
    gen = d / "gen.jsonl"
    gen.write_text("".join(json.dumps({"prompt": p, "target": t}) + "\n" for p, t in GEN))
    mc = d / "mc.jsonl"
    mc.write_text("".join(json.dumps({"context": c, "choices": ch, "label": y}) + "\n"
                          for c, ch, y in MC))
    (d / "jspec_gen.yaml").write_text(f"""task: jspec_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {MAX_GEN}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    (d / "jspec_mc.yaml").write_text(f"""task: jspec_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")


def _args(sample) -> tuple:
    """A sample's request arguments as a tuple (lm-eval versions store them differently)."""
    a = sample["arguments"]
    if isinstance(a, dict):                          # {"gen_args_0": {"arg_0": .., ...}}
        return [tuple(v.values()) for v in a.values()]
    return [tuple(x) for x in a]


def test_lm_eval_scores_equal_in_process(tmp_path, monkeypatch):
    for k, v in {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                 "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf"),
                 "TOKENIZERS_PARALLELISM": "false"}.items():
        monkeypatch.setenv(k, v)
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    _write_tasks(tasks_dir)

    server = serve_process.start(["--model", MODEL, "--slots", "2", "--max-tokens", "32",
                                  "--max-prompt-tokens", "64", "--max-logprobs", "1",
                                  "--kernels", "reference", "--chunk", "4"],
                                 tmp_path / "server.log")
    try:
        import lm_eval
        from lm_eval.models.openai_completions import LocalCompletionsAPI
        from lm_eval.models.api_models import TemplateAPI

        payloads, ll_requests = [], {}
        make_payload = LocalCompletionsAPI._create_payload
        batch_ll = TemplateAPI.batch_loglikelihood_requests

        def record_payload(self, *a, **kw):
            p = make_payload(self, *a, **kw)
            payloads.append(json.loads(json.dumps(p)))
            return p

        def record_ll(self, chunks):
            inputs, ctxlens, keys = batch_ll(self, chunks)
            ll_requests.update({tuple(k): (list(i), n) for k, i, n in zip(keys, inputs, ctxlens)})
            return inputs, ctxlens, keys

        monkeypatch.setattr(LocalCompletionsAPI, "_create_payload", record_payload)
        monkeypatch.setattr(TemplateAPI, "batch_loglikelihood_requests", record_ll)

        model_args = (f"base_url={server.base}/v1/completions,model={MODEL},"
                      "tokenizer_backend=remote,num_concurrent=1,max_retries=1,"
                      "max_length=64,timeout=120")
        results = lm_eval.simple_evaluate(
            model="local-completions", model_args=model_args,
            tasks=["jspec_gen", "jspec_mc"],
            task_manager=lm_eval.tasks.TaskManager(include_path=str(tasks_dir)),
            limit=None, log_samples=True, random_seed=0, numpy_random_seed=0,
            torch_random_seed=0, fewshot_random_seed=0, bootstrap_iters=0)
    finally:
        serve_process.stop(server)

    # --- in-process, on the ids lm-eval sent ---
    import jspec
    from jspec.scoring import teacher_forced
    from jspec.shipped import default_model

    target = jspec.load_target(default_model())
    tok = target.tokenizer

    gen_payloads = [p for p in payloads if not p.get("echo")]
    assert len(gen_payloads) == len(GEN)
    for p in gen_payloads:                   # one prompt per request, as generate_until sends
        assert len(p["prompt"]) == 1 and isinstance(p["prompt"][0][0], int), p
        assert p["max_tokens"] == MAX_GEN and p["temperature"] == 0, p
        assert "\n" in p["stop"], p
    stops = gen_payloads[0]["stop"]
    assert all(p["stop"] == stops for p in gen_payloads)
    prompts = [p["prompt"][0] for p in gen_payloads]
    out = jspec.generate(target, prompts, max_new_tokens=MAX_GEN, temperature=0.0,
                         kernels="reference")
    want_text = {}
    for ids, toks in zip(prompts, out.tokens):
        text = tok.decode([t for t in toks if t not in target.config.eos_token_ids])
        cut = min([text.index(s) for s in stops if s in text], default=len(text))
        want_text[tuple(ids)] = text[:cut]

    samples = results["samples"]
    gen_hits = []
    for s in samples["jspec_gen"]:
        (ctx, _gen_kwargs), = _args(s)
        ids = tuple(tok.encode(ctx, bos=False))
        assert ids in want_text, (ctx, ids)
        got, = s["resps"][0] if isinstance(s["resps"][0], list) else [s["resps"][0]]
        assert got == want_text[ids], (ctx, got, want_text[ids])
        hit = float(want_text[ids] == s["target"])
        assert s["exact_match"] == hit, (ctx, s["exact_match"], want_text[ids], s["target"])
        gen_hits.append(hit)
    assert len(gen_hits) == len(GEN)

    ll_payloads = [p for p in payloads if p.get("echo")]
    assert all(p["max_tokens"] == 1 and p["logprobs"] == 1 for p in ll_payloads)
    n_choices = sum(len(ch) for _, ch, _ in MC)
    assert len(ll_requests) == n_choices and len(ll_payloads) == n_choices
    sent = sorted(tuple(p["prompt"][0]) for p in ll_payloads)
    assert sent == sorted(tuple(i) for i, _ in ll_requests.values())

    # Causal: tokens appended after a sequence leave its logprobs unchanged, so every
    # sequence is padded to one length and scored by one compiled forward.
    width = max(len(i) for i, _ in ll_requests.values())
    want_ll = {}
    for key, (ids, ctxlen) in ll_requests.items():
        lp = teacher_forced(target, ids + [0] * (width - len(ids)), k=1)[:len(ids)]
        cont = lp[ctxlen:]
        want_ll[key] = (sum(e.logprob for e in cont),
                        all(e.token == e.top[0][0] for e in cont))

    mc_hits = []
    for s in samples["jspec_mc"]:
        args = _args(s)
        resps = [r[0] if isinstance(r, list) else r for r in s["resps"]]
        assert len(args) == len(resps) == len(MC[s["doc_id"]][1])
        lls = []
        for a, (ll, greedy) in zip(args, resps):
            wll, wgreedy = want_ll[tuple(a)]
            assert math.isclose(ll, wll, rel_tol=1e-4, abs_tol=1e-4), (a, ll, wll)
            assert bool(greedy) == wgreedy, (a, greedy, wgreedy)
            lls.append(wll)
        hit = float(max(range(len(lls)), key=lls.__getitem__) == s["target"])
        assert s["acc"] == hit, (s["doc_id"], lls, s["target"])
        mc_hits.append(hit)
    assert len(mc_hits) == len(MC)

    em = results["results"]["jspec_gen"]["exact_match,none"]
    acc = results["results"]["jspec_mc"]["acc,none"]
    print(f"\nlm-eval via jspec serve: exact_match={em} acc={acc}; in-process: "
          f"exact_match={sum(gen_hits) / len(gen_hits)} acc={sum(mc_hits) / len(mc_hits)}")
    print("completions:", json.dumps(list(want_text.values())))
    assert em == pytest.approx(sum(gen_hits) / len(gen_hits))
    assert acc == pytest.approx(sum(mc_hits) / len(mc_hits))
