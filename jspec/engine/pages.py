"""The engine's page budget on the host: which pages of the KV pools are free.

A request takes pages for its whole need when it is admitted (prompt, ``max_new_tokens``
and the speculative overshoot) and gives them back when it finishes, so a row never runs
out mid-decode and admission is the one place a budget can say no. Nothing on device
allocates; the compiled programs only read the page tables they are given.
"""

from __future__ import annotations

import heapq

from jspec import kv_cache as kvc


class PagePool:
    def __init__(self, num_pages: int, page_size: int, max_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages, self.page_size, self.max_pages = num_pages, page_size, max_pages
        self._free = list(range(num_pages))        # a heap: lowest ids first, reproducibly
        heapq.heapify(self._free)

    @property
    def free(self) -> int:
        return len(self._free)

    def needed(self, tokens: int) -> int:
        return kvc.pages_needed(tokens, self.page_size)

    def take(self, tokens: int) -> list[int] | None:
        """Pages for ``tokens`` slots, or None while too few are free. A need that one row's
        page table cannot hold is an error."""
        n = self.needed(tokens)
        if n > self.max_pages:
            raise kvc.KVCacheExhaustedError(
                f"a row of {tokens} slots needs {n} pages of {self.page_size}; a row holds at most "
                f"{self.max_pages} (raise max_len)")
        if n > len(self._free):
            return None
        return [heapq.heappop(self._free) for _ in range(n)]

    def give_back(self, pages: list[int]) -> None:
        for p in pages:
            heapq.heappush(self._free, p)
