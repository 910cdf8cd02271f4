"""Page admission for a static batch: the prompt block, the output buffer, the page budget
and every row's page table (:func:`admit`), checked on the host before anything compiles."""

from __future__ import annotations

import math

import numpy as np

from jspec import kv_cache as kvc, shape_buckets as buckets

ADMISSIONS = ("reserve", "partial")


def admit(lens, limits, overshoot, prompt_bucket, max_len, page_size, num_pages, shards=1,
          agreed=None, admission="reserve", bucketed=False, max_positions=None):
    """Static shapes and pages for a batch: ``(T, cap_new, num_pages, page_table)``.

    A row needs its prompt, its new tokens and the speculative overshoot (the prefill
    writes only real prompt positions; padding is masked). ``admission="reserve"`` refuses
    a batch whose needs do not all fit; ``"partial"`` refuses only one whose minimums do not
    (prompt plus one iteration's slots) and gives the rest out in row order
    (:func:`jspec.kv_cache.partial_page_table`).
    ``shards`` > 1 (a mesh's data axis): rows split into that many contiguous groups, each
    with a pool of its own; ``num_pages`` (given: the total) is then one shard's pool and
    the table holds page ids local to each row's shard. ``agreed``: (longest prompt, most new
    tokens) over every process of a multi-host run, so all compile the same shapes.
    ``bucketed``: the prompt block and (``max_len`` None) the KV length are rounded up to
    :mod:`jspec.shape_buckets`' buckets (the KV no further than ``max_positions``, the
    model's, unless the batch needs more), the output buffer (``cap_new``) filling the KV.
    """
    if admission not in ADMISSIONS:
        raise ValueError(f"kv_admission={admission!r}: expected one of {ADMISSIONS}")
    B = len(lens)
    top_len, top_new = agreed if agreed is not None else (int(lens.max()), int(limits.max()))
    cap_new = max(1, top_new)
    T = int(math.ceil(top_len / prompt_bucket) * prompt_bucket)
    if bucketed:
        T = buckets.prompt(top_len, prompt_bucket)
        if max_len is None:
            max_len = buckets.kv(T + cap_new + overshoot, max_positions)
            cap_new = max_len - T - overshoot
    if max_len is None:
        max_len = T + cap_new + overshoot
    for r in range(B):
        if lens[r] + limits[r] + overshoot > max_len:
            extra = f" plus {overshoot} slots of speculative overshoot" if overshoot else ""
            raise ValueError(
                f"prompt {r} has {lens[r]} tokens and asks for {limits[r]} new ones{extra}, more "
                f"than the cache length max_len={max_len}")
    max_pages = kvc.pages_needed(max_len, page_size)
    if num_pages is None:
        num_pages = B * max_pages
    local = num_pages // shards
    need = [int(lens[r] + limits[r] + overshoot) for r in range(B)]
    # One iteration writes `overshoot` slots past the committed length (plain decoding: 1).
    floor = [min(need[r], int(lens[r]) + max(overshoot, 1)) for r in range(B)]
    rows = B // shards
    tables = []
    for sh in range(shards):
        part = slice(sh * rows, (sh + 1) * rows)
        try:
            if admission == "partial":
                table = kvc.partial_page_table(floor[part], need[part], page_size, local,
                                               max_pages)
            else:
                table = kvc.allocate_page_table(need[part], page_size, local, max_pages)
        except kvc.KVCacheExhaustedError as e:
            where = f" (data shard {sh}: rows {sh * rows}..{(sh + 1) * rows - 1}, {local} pages)" \
                if shards > 1 else ""
            raise kvc.KVCacheExhaustedError(f"{e}{where}") from None
        tables.append(table)
    return T, cap_new, local, np.concatenate(tables)
