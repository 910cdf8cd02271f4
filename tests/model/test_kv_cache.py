import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jspec import kv_cache as kvc
from jspec.shapes import check_shapes

L, H, D = 2, 3, 4


def make(tokens_per_row, page_size=4, num_pages=None, max_pages=None):
    num_pages = num_pages or sum(kvc.pages_needed(n, page_size) for n in tokens_per_row)
    pt = kvc.allocate_page_table(tokens_per_row, page_size, num_pages, max_pages)
    return kvc.init_cache(L, H, D, pt, num_pages, page_size)


def write_all(cache, k, v, valid=None):
    for layer in range(L):
        cache = kvc.write_layer(cache, layer, k[layer], v[layer], valid)
    return cache


def rand_kv(rng, B, T):
    return (rng.standard_normal((L, B, T, H, D)).astype(np.float32),
            rng.standard_normal((L, B, T, H, D)).astype(np.float32))


def row_view(cache, layer=0):
    """[B, max_len, KVH, D] contiguous view of every row."""
    k, v = kvc.read_layer(cache, layer)
    return np.asarray(k.swapaxes(1, 2)), np.asarray(v.swapaxes(1, 2))


def test_write_then_read_round_trip_ragged():
    rng = np.random.default_rng(0)
    cache = make([7, 13, 3], page_size=4)
    check_shapes(cache)
    k, v = rand_kv(rng, 3, 6)
    valid = jnp.asarray(np.arange(6)[None] < np.array([[6], [5], [3]]))
    cache = write_all(cache, k, v, valid)
    cache = kvc.advance(cache, jnp.array([6, 5, 3]))
    for layer in range(L):
        kr, vr = row_view(cache, layer)
        for b, n in enumerate([6, 5, 3]):
            np.testing.assert_array_equal(kr[b, :n], k[layer, b, :n])
            np.testing.assert_array_equal(vr[b, :n], v[layer, b, :n])
    # A second block lands after each row's own length.
    k2, v2 = rand_kv(rng, 3, 1)
    cache = kvc.advance(write_all(cache, k2, v2), 1)
    kr, _ = row_view(cache)
    for b, n in enumerate([6, 5, 3]):
        np.testing.assert_array_equal(kr[b, n], k2[0, b, 0])
    np.testing.assert_array_equal(np.asarray(cache.lengths), [7, 6, 4])


def test_accelerator_write_form_equals_cpu_form():
    """write_layer scatters per (layer, head, slot) on TPU/GPU and per (layer, slot) on CPU
    (each backend's fast form); both must leave the same pool, dropped writes included."""
    from jspec.platform import building_for
    rng = np.random.default_rng(3)
    k, v = rand_kv(rng, 3, 6)
    valid = jnp.asarray(np.arange(6)[None] < np.array([[6], [2], [0]]))
    caches = {}
    for platform in ("cpu", "gpu"):
        with building_for(platform):     # traced for that platform, run here
            cache = kvc.advance(make([7, 13, 3]), jnp.array([1, 4, 0]))
            caches[platform] = jax.jit(write_all)(cache, k, v, valid)
    for a, b in zip(jax.tree.leaves(caches["cpu"]), jax.tree.leaves(caches["gpu"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.abs(np.asarray(caches["cpu"].k_pages)).sum() > 0


def test_rows_never_touch_each_others_pages():
    cache = make([4, 4], page_size=4)
    k = np.ones((L, 2, 8, H, D), np.float32)
    k[:, 1] = 2.0
    # Row 0 writes 8 positions but owns 4 slots: the overflow is dropped, not spilled into row 1.
    cache = write_all(cache, k, k)
    kr, _ = row_view(cache)
    assert np.all(kr[1, :4] == 2.0)
    assert np.all(kr[0, :4] == 1.0)


def test_allocation_refuses_what_does_not_fit():
    with pytest.raises(kvc.KVCacheExhaustedError, match="row 2 needs 2 pages"):
        kvc.allocate_page_table([8, 8, 5], page_size=4, num_pages=5)
    with pytest.raises(kvc.KVCacheExhaustedError, match="at most 2 pages"):
        kvc.allocate_page_table([9], page_size=4, num_pages=10, max_pages_per_row=2)
    pt = kvc.allocate_page_table([8, 1], page_size=4, num_pages=3, max_pages_per_row=2)
    np.testing.assert_array_equal(pt, [[0, 1], [2, 3]])  # 3 = unallocated sentinel


@settings(max_examples=12, deadline=None)
@given(st.data())
def test_commit_equals_writing_only_the_subset(data):
    """Write T positions after each row's prefix, keep a subset: same as writing only it."""
    B = data.draw(st.integers(1, 3))
    T = data.draw(st.integers(1, 6))
    page_size = data.draw(st.sampled_from([1, 2, 3, 4, 8]))
    prefix = [data.draw(st.integers(0, 9)) for _ in range(B)]
    keeps = [sorted(data.draw(st.sets(st.integers(0, T - 1)))) for _ in range(B)]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    need = [p + T for p in prefix]
    P0 = max(prefix)
    kp, vp = rand_kv(rng, B, max(P0, 1))
    kb, vb = rand_kv(rng, B, T)

    def with_prefix():
        c = make(need, page_size)
        valid = jnp.asarray(np.arange(max(P0, 1))[None] < np.array(prefix)[:, None])
        c = write_all(c, kp, vp, valid)
        return kvc.advance(c, jnp.array(prefix))

    spec = write_all(with_prefix(), kb, vb)
    keep = np.zeros((B, T), np.int32)
    for b, ks in enumerate(keeps):
        keep[b, :len(ks)] = ks
    n = np.array([len(ks) for ks in keeps], np.int32)
    spec = kvc.commit(spec, jnp.asarray(keep), jnp.asarray(n))

    gk = np.take_along_axis(kb, keep[None, :, :, None, None], axis=2)
    gv = np.take_along_axis(vb, keep[None, :, :, None, None], axis=2)
    plain = write_all(with_prefix(), gk, gv, jnp.asarray(np.arange(T)[None] < n[:, None]))
    plain = kvc.advance(plain, jnp.asarray(n))

    np.testing.assert_array_equal(np.asarray(spec.lengths), np.asarray(plain.lengths))
    for layer in range(L):
        ks_, vs_ = row_view(spec, layer)
        kp_, vp_ = row_view(plain, layer)
        for b in range(B):
            m = prefix[b] + n[b]
            np.testing.assert_array_equal(ks_[b, :m], kp_[b, :m])
            np.testing.assert_array_equal(vs_[b, :m], vp_[b, :m])


def test_commit_jits_with_per_row_counts():
    cache = make([6, 6], page_size=2)
    rng = np.random.default_rng(1)
    k, v = rand_kv(rng, 2, 4)
    cache = write_all(cache, k, v)
    f = jax.jit(kvc.commit)
    out = f(cache, jnp.array([[0, 2, 3], [1, 0, 0]]), jnp.array([3, 1]))
    kr, _ = row_view(out)
    np.testing.assert_array_equal(kr[0, :3], k[0, 0, [0, 2, 3]])
    np.testing.assert_array_equal(kr[1, :1], k[0, 1, [1]])
    np.testing.assert_array_equal(np.asarray(out.lengths), [3, 1])
