"""The C kernel of the active-set iteration (sv_attention.svdd.active_set_native) against the torch loop.

The torch loop of :func:`sv_attention.svdd.warm_fit.active_set_fit` (``engine="torch"``) is the reference;
the kernel must land on the same partitions and solutions, and on the exact optimum of the SVDD problem.
"""

import warnings

import pytest
import torch

from sv_attention.kernels import median_bandwidth, rbf_gram
from sv_attention.svdd import native_build
from sv_attention.svdd.batched import solve_batched
from sv_attention.svdd.polish import polish_ridge
from sv_attention.svdd.warm_fit import active_set_fit, fit_warm, partition_from_alpha, polish_tol

C = 1.0 / (0.5 * 32)
#: tests that run the kernel need a C compiler (CI and this machine have one; elsewhere they are skipped, reported)
needs_kernel = pytest.mark.skipif(native_build.compiler() is None or not native_build.native_enabled(),
                                  reason="no C compiler (or SV_ATTENTION_NATIVE=0): the native kernels cannot be built")


def _gram(seed: int, G: int = 8, n: int = 96, d: int = 8, dtype=torch.float64, spread: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(G, n, d, generator=gen, dtype=torch.float64)
    return rbf_gram(keys, sigma=spread * median_bandwidth(keys)[:, None, None]).to(dtype)


def _both(gram, mask, margin, error, *, steps=64, start=None):
    dt = gram.dtype
    kw = dict(C=C, steps=steps, tol=polish_tol(dt), ridge=polish_ridge(dt), start_alpha=start)
    ref = active_set_fit(gram, mask, margin, error, engine="torch", **kw)
    fast = active_set_fit(gram, mask, margin, error, engine="native", **kw)
    assert ref.engine == "torch" and fast.engine == "native"
    return ref, fast


@needs_kernel
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cold_fits_equal_the_torch_loop_and_the_exact_optimum_in_float64(seed):
    gram = _gram(seed)
    G, n, _ = gram.shape
    mask = torch.ones(G, n, dtype=torch.bool)
    ref, fast = _both(gram, mask, mask.clone(), torch.zeros_like(mask))
    assert fast.settled.all() and ref.settled.all()
    assert torch.equal(fast.margin, ref.margin) and torch.equal(fast.error, ref.error)
    assert ref.steps <= fast.steps <= ref.steps + 1  # + the final solve from a fresh factor
    assert (fast.alpha - ref.alpha).abs().max() < 1e-12
    assert (fast.rho - ref.rho).abs().max() < 1e-12
    exact = solve_batched(gram, mask, C, ridge=0.0).alpha.clamp_min(0.0)
    assert (fast.alpha - exact).abs().max() < 1e-5
    assert (fast.alpha.sum(-1) - 1.0).abs().max() < 1e-12 and fast.violation.max() < 10 * polish_tol(gram.dtype)


@needs_kernel
def test_warm_fits_from_the_previous_boundary_read_the_known_start_and_equal_the_torch_loop():
    gram = _gram(4, n=128)
    G, n, _ = gram.shape
    mask = torch.ones(G, n, dtype=torch.bool)
    prev = active_set_fit(gram[:, :96, :96], mask[:, :96], mask[:, :96].clone(), torch.zeros_like(mask[:, :96]),
                          C, 64, polish_tol(gram.dtype), polish_ridge(gram.dtype), engine="torch").alpha
    start = torch.nn.functional.pad(prev, (0, 32))
    margin, error = partition_from_alpha(start, C)
    ref, fast = _both(gram, mask, margin, error, start=start)
    assert fast.settled.all() and torch.equal(fast.margin, ref.margin)
    assert (fast.alpha - ref.alpha).abs().max() < 1e-12
    # the first step was read off the start: one solve fewer than from the same partition without it
    _, unknown = _both(gram, mask, margin, error)
    assert fast.steps == unknown.steps - 1


@needs_kernel
def test_float32_grams_are_solved_in_float64_and_agree_with_the_torch_loop():
    gram = _gram(5, dtype=torch.float32)
    G, n, _ = gram.shape
    mask = torch.ones(G, n, dtype=torch.bool)
    ref, fast = _both(gram, mask, mask.clone(), torch.zeros_like(mask))
    assert fast.alpha.dtype == torch.float32 and fast.settled.all() and ref.settled.all()
    assert (fast.alpha - ref.alpha).abs().max() < 1e-5
    exact = solve_batched(gram.double(), mask, C, ridge=0.0).alpha.clamp_min(0.0)
    assert (fast.alpha.double() - exact).abs().max() < (ref.alpha.double() - exact).abs().max() + 1e-6


@needs_kernel
def test_flat_grams_take_the_pivoting_safeguard_and_settle_like_the_torch_loop():
    """Keys near a 2-d subspace make the Gram flat (the block rule alone cycles): both paths take the same
    single pivots and settle every problem at the same partition."""
    gen = torch.Generator().manual_seed(6)
    latent = torch.randn(16, 64, 2, generator=gen, dtype=torch.float64)
    keys = latent @ torch.randn(2, 64, generator=gen, dtype=torch.float64) \
        + 0.3 * torch.randn(16, 64, 64, generator=gen, dtype=torch.float64)
    gram = rbf_gram(keys, sigma=median_bandwidth(keys)[:, None, None])
    G, n, _ = gram.shape
    mask = torch.ones(G, n, dtype=torch.bool)
    ref, fast = _both(gram, mask, mask.clone(), torch.zeros_like(mask))
    assert fast.settled.all() and ref.settled.all() and ref.steps > 10
    assert ref.steps <= fast.steps <= ref.steps + 1  # single pivots update the factor; the last solve is fresh
    assert torch.equal(fast.margin, ref.margin) and torch.equal(fast.error, ref.error)
    assert (fast.alpha - ref.alpha).abs().max() < 1e-10


@needs_kernel
def test_invalid_keys_are_ignored_and_get_no_weight():
    gram = _gram(7)
    G, n, _ = gram.shape
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(G, n, generator=gen) > 0.25
    ref, fast = _both(gram, mask, mask.clone(), torch.zeros_like(mask))
    assert fast.settled.all() and (fast.alpha[~mask] == 0).all() and not (fast.margin | fast.error)[~mask].any()
    assert (fast.alpha - ref.alpha).abs().max() < 1e-12
    exact = solve_batched(gram, mask, C, ridge=0.0).alpha.clamp_min(0.0)
    assert (fast.alpha - torch.where(mask, exact, torch.zeros_like(exact))).abs().max() < 1e-5


@needs_kernel
def test_a_step_budget_leaves_the_same_problems_unsettled():
    gram = _gram(8, spread=3.0)
    G, n, _ = gram.shape
    mask = torch.ones(G, n, dtype=torch.bool)
    ref, fast = _both(gram, mask, mask.clone(), torch.zeros_like(mask), steps=2)
    assert not fast.settled.all() and torch.equal(fast.settled, ref.settled)
    assert torch.equal(fast.margin, ref.margin) and torch.equal(fast.error, ref.error)


@needs_kernel
def test_fit_warm_counts_the_engine_that_ran():
    gram = _gram(9)
    G, n, _ = gram.shape
    stats: dict[str, int] = {}

    def count(key: str, k: int = 1) -> None:
        stats[key] = stats.get(key, 0) + k

    uniform = torch.full((G, n), 1.0 / n, dtype=gram.dtype)
    fit_warm(gram, uniform, C, 0, solve=lambda *a, **k: None, count=count)
    assert stats["active_set_native"] == G and "active_set_torch" not in stats


@needs_kernel
def test_a_gram_with_autograd_or_a_bad_engine_name_is_refused_by_the_native_engine():
    gram = _gram(10).requires_grad_(True)
    G, n, _ = gram.shape
    mask = torch.ones(G, n, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="dense CPU"):
        active_set_fit(gram, mask, mask, torch.zeros_like(mask), C, 8, 1e-12, 1e-10, engine="native")
    with pytest.raises(ValueError, match="engine"):
        active_set_fit(gram.detach(), mask, mask, torch.zeros_like(mask), C, 8, 1e-12, 1e-10, engine="cuda")
    auto = active_set_fit(gram, mask, mask, torch.zeros_like(mask), C, 64, polish_tol(gram.dtype),
                          polish_ridge(gram.dtype))
    assert auto.engine == "torch" and auto.settled.all()


def test_a_kernel_that_cannot_be_built_is_reported_and_the_torch_loop_runs(monkeypatch, tmp_path):
    monkeypatch.setattr(native_build, "_LOADED", {})
    monkeypatch.setattr(native_build, "_REASONS", {})
    monkeypatch.setenv("SV_ATTENTION_CACHE", str(tmp_path))
    monkeypatch.setattr(native_build, "_compiler", lambda: None)
    gram = _gram(11)
    G, n, _ = gram.shape
    mask = torch.ones(G, n, dtype=torch.bool)
    with pytest.warns(RuntimeWarning, match="could not be built.*no C compiler"):
        fit = active_set_fit(gram, mask, mask, torch.zeros_like(mask), C, 64, polish_tol(gram.dtype),
                             polish_ridge(gram.dtype))
    assert fit.engine == "torch" and fit.settled.all()
    with pytest.raises(RuntimeError, match="not available.*no C compiler"):
        active_set_fit(gram, mask, mask, torch.zeros_like(mask), C, 8, 1e-12, 1e-10, engine="native")
    assert not list(tmp_path.iterdir())


@needs_kernel
def test_a_failed_compilation_is_reported_with_the_compiler_message(monkeypatch, tmp_path):
    monkeypatch.setattr(native_build, "_LOADED", {})
    monkeypatch.setenv("SV_ATTENTION_CACHE", str(tmp_path))
    with pytest.warns(RuntimeWarning, match="could not be built.*failed"):
        assert native_build.load_kernel("broken", "int f( {") is None


def test_the_switch_turns_the_kernel_off_without_a_warning(monkeypatch):
    monkeypatch.setenv(native_build.ENV_SWITCH, "0")
    gram = _gram(12)
    G, n, _ = gram.shape
    mask = torch.ones(G, n, dtype=torch.bool)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit = active_set_fit(gram, mask, mask, torch.zeros_like(mask), C, 64, polish_tol(gram.dtype),
                             polish_ridge(gram.dtype))
    assert fit.engine == "torch"


@needs_kernel
def test_the_kernel_is_compiled_once_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(native_build, "_LOADED", {})
    monkeypatch.setenv("SV_ATTENTION_CACHE", str(tmp_path))
    src = "int sv_answer(void) { return 42; }\n"
    lib = native_build.load_kernel("answer", src)
    assert lib is not None and lib.sv_answer() == 42
    built = list(tmp_path.glob("answer-*/answer.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(native_build, "_LOADED", {})
    assert native_build.load_kernel("answer", src).sv_answer() == 42
    assert built[0].stat().st_mtime_ns == stamp


@needs_kernel
def test_without_openmp_the_kernel_starts_its_own_threads_with_the_same_results(monkeypatch, tmp_path):
    """A compiler without OpenMP (here: flags it refuses) builds the POSIX-thread variant; it gives the same
    gates as the OpenMP build, on one thread and on several."""
    from sv_attention.svdd import active_set_native

    gram = _gram(3, G=5, n=48)
    G, n, _ = gram.shape
    mask = torch.ones(G, n, dtype=torch.bool)
    args = (gram, mask, mask.clone(), torch.zeros_like(mask), C, 64, 1e-9, 1e-10, 10.0, 3, None)
    reference = active_set_native.run_active_set(active_set_native.kernel(), *args)
    monkeypatch.setattr(native_build, "_LOADED", {})
    monkeypatch.setenv("SV_ATTENTION_CACHE", str(tmp_path))
    monkeypatch.setattr(native_build, "OPENMP_FLAGS", ("-fno-such-openmp-flag",))
    lib = active_set_native.kernel()
    assert lib is not None and not native_build.uses_openmp(lib)
    for threads in (1, 3):
        monkeypatch.setattr(active_set_native, "outer_threads", lambda t=threads: t)
        got = active_set_native.run_active_set(lib, *args)
        assert torch.equal(got["alpha"], reference["alpha"]) and torch.equal(got["margin"], reference["margin"])


@needs_kernel
def test_a_slice_of_a_larger_gram_is_read_in_place_with_the_same_result():
    """The prefill fits boundary s on the view ``full[..., :s, :s]``: rows ld > s apart, no copy."""
    full = _gram(13, n=128)
    view = full[:, :96, :96]
    assert not view.is_contiguous()
    G, n, _ = view.shape
    mask = torch.ones(G, n, dtype=torch.bool)
    kw = dict(C=C, steps=64, tol=polish_tol(full.dtype), ridge=polish_ridge(full.dtype), engine="native")
    a = active_set_fit(view, mask, mask.clone(), torch.zeros_like(mask), **kw)
    b = active_set_fit(view.contiguous(), mask, mask.clone(), torch.zeros_like(mask), **kw)
    assert a.settled.all() and torch.equal(a.alpha, b.alpha) and torch.equal(a.margin, b.margin)


@needs_kernel
def test_a_lazy_row_store_is_read_in_place_and_grown_on_demand_with_the_dense_result():
    """Decoding fits read Gram rows on demand (LazyRBFGram): the kernel computes the rows it reads into the
    store; results equal the dense kernel and the torch loop on the same lazy Gram, and only a fraction of
    the rows is ever computed."""
    from sv_attention.svdd.gram_rows import LazyRBFGram

    gen = torch.Generator().manual_seed(14)
    keys = torch.randn(4, 320, 8, generator=gen, dtype=torch.float64)
    sigma = median_bandwidth(keys)
    s = 256
    dense = rbf_gram(keys[:, :s], sigma=sigma[:, None, None])
    G = keys.shape[0]
    mask = torch.ones(G, s, dtype=torch.bool)
    kw = dict(C=C, steps=256, tol=polish_tol(keys.dtype), ridge=polish_ridge(keys.dtype))
    prev = active_set_fit(dense[:, :192, :192], mask[:, :192], mask[:, :192].clone(), torch.zeros_like(mask[:, :192]),
                          engine="native", **kw).alpha
    start = torch.nn.functional.pad(prev, (0, s - 192))
    margin, error = partition_from_alpha(start, C)
    lazy = LazyRBFGram(keys, sigma).prefix(s)
    fast = active_set_fit(lazy, mask, margin, error, start_alpha=start, engine="native", **kw)
    ref = active_set_fit(LazyRBFGram(keys, sigma).prefix(s), mask, margin, error, start_alpha=start, engine="torch",
                         **kw)
    full = active_set_fit(dense, mask, margin, error, start_alpha=start, engine="native", **kw)
    assert fast.engine == "native" and fast.settled.all() and ref.settled.all()
    assert torch.equal(fast.margin, full.margin) and torch.equal(fast.margin, ref.margin)
    assert (fast.alpha - full.alpha).abs().max() < 1e-12 and (fast.alpha - ref.alpha).abs().max() < 1e-12
    assert 0 < lazy.parent.rows_computed < G * s // 2


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_rows_computed_by_the_kernel_equal_the_rbf_gram_and_a_full_store_grows(dtype, tol):
    """The kernel computes missing rows of a LazyRBFGram itself (the RBF formula of
    sv_attention.kernels.rbf_gram, its reference); a store that fills up is doubled and the waiting
    problems resume."""
    from sv_attention.svdd.gram_rows import LazyRBFGram

    gen = torch.Generator().manual_seed(15)
    keys = torch.randn(3, 200, 8, generator=gen, dtype=torch.float64).to(dtype)
    sigma = median_bandwidth(keys)
    parent = LazyRBFGram(keys, sigma, capacity=4)
    G, n = 3, 160
    mask = torch.ones(G, n, dtype=torch.bool)
    fit = active_set_fit(parent.prefix(n), mask, mask.clone(), torch.zeros_like(mask), C, 256, polish_tol(dtype),
                         polish_ridge(dtype), engine="native")
    dense = rbf_gram(keys[:, :n], sigma=sigma[:, None, None])
    ref = active_set_fit(dense, mask, mask.clone(), torch.zeros_like(mask), C, 256, polish_tol(dtype),
                         polish_ridge(dtype), engine="native")
    assert fit.settled.all() and torch.equal(fit.margin, ref.margin)
    assert (fit.alpha - ref.alpha).abs().max() < 10 * tol
    assert parent.store.shape[1] > 4 and parent.rows_computed == int(parent.filled.sum())
    full = rbf_gram(keys, sigma=sigma[:, None, None])
    for p in range(G):
        stored = (parent.slot[p] >= 0).nonzero().flatten()
        assert len(stored) >= (fit.margin[p] | fit.error[p]).sum()
        rows = parent.store[p, parent.slot[p, stored]]
        assert (rows - full[p, stored]).abs().max() < tol


@needs_kernel
def test_non_finite_grams_leave_their_problem_unsettled_and_the_others_exact():
    """A NaN or inf entry (a broken key) ends that problem unsettled (the caller's fallback refits it); the
    kernel neither crashes nor spreads it to the batch's other problems."""
    gram = _gram(16, G=3, n=40)
    gram[0, 3, 5] = gram[0, 5, 3] = float("nan")
    gram[1] = float("inf")
    G, n, _ = gram.shape
    mask = torch.ones(G, n, dtype=torch.bool)
    ref, fast = _both(gram, mask, mask.clone(), torch.zeros_like(mask))
    assert fast.settled.tolist() == [False, False, True] and ref.settled[2]
    assert (fast.alpha[2] - ref.alpha[2]).abs().max() < 1e-12


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_chain_of_boundaries_in_one_call_equals_one_call_per_boundary(dtype):
    """run_active_set_chain: boundary b starts from boundary b - 1's final partition and solution, as the
    boundary-by-boundary fits do; the results are the same bits."""
    from sv_attention.svdd import active_set_native as native

    gram = _gram(17, G=4, n=256, dtype=dtype)
    G, N, _ = gram.shape
    bounds = [64, 128, 192, 256]
    kw = dict(C=C, steps=256, tol=polish_tol(dtype), ridge=polish_ridge(dtype))
    first = torch.arange(N) < bounds[0]
    chain = native.run_active_set_chain(native.kernel(), gram, bounds, first.expand(G, N), torch.zeros(G, N, dtype=torch.bool),
                                        kw["C"], kw["steps"], kw["tol"], kw["ridge"], 10.0, 3, None)
    prev = None
    for b, s in enumerate(bounds):
        mask = torch.ones(G, s, dtype=torch.bool)
        if prev is None:
            fit = active_set_fit(gram[:, :s, :s], mask, mask.clone(), torch.zeros_like(mask), engine="native", **kw)
        else:
            start = torch.nn.functional.pad(prev, (0, s - prev.shape[1]))
            fit = active_set_fit(gram[:, :s, :s], mask, *partition_from_alpha(start, C), start_alpha=start,
                                 engine="native", **kw)
        assert fit.settled.all() and torch.equal(chain["settled"][:, b], fit.settled)
        assert torch.equal(chain["alpha"][:, b, :s].to(dtype), fit.alpha) and not chain["alpha"][:, b, s:].any()
        assert torch.equal(chain["margin"][:, b, :s], fit.margin) and torch.equal(chain["error"][:, b, :s], fit.error)
        prev = fit.alpha
    # factorisations from scratch: at least one for the cold first boundary, never more than one per solve
    assert (chain["factorizations"][:, 0] >= 1).all() and (chain["factorizations"] <= chain["solves"] + 1).all()
    with pytest.raises(ValueError, match="bounds"):
        native.run_active_set_chain(native.kernel(), gram, [64, 64], first.expand(G, N), torch.zeros(G, N, dtype=torch.bool),
                                    C, 8, 1e-9, 1e-10, 10.0, 3, None)


@needs_kernel
def test_fit_chain_refits_what_does_not_settle_and_equals_the_boundary_by_boundary_fits(monkeypatch):
    """With a step budget too small to settle, the chain's unsettled boundaries go to the fallbacks of
    fit_warm (counted) and every gate still equals the exact optimum."""
    from sv_attention.svdd import warm_fit

    gram = _gram(18, G=3, n=192)
    G, N, _ = gram.shape
    bounds = [64, 128, 192]
    stats: dict[str, int] = {}

    def count(key: str, k: int = 1) -> None:
        stats[key] = stats.get(key, 0) + k

    def solve(g, mask, C_, init=None):
        return solve_batched(g, mask, C_, check_inputs=False, ridge=polish_ridge(g.dtype), init_alpha=init)

    monkeypatch.setattr(warm_fit, "NATIVE_PDAS_STEPS", 1)
    fitted = warm_fit.fit_chain(gram, bounds, None, C, solve=solve, count=count)
    # a problem refitted at a boundary redoes the rest of its chain from the refitted gate (more chain calls)
    assert stats["chain_fits"] >= 1 and stats["pdas_problems"] >= G * len(bounds)
    assert stats["warm_pdas_fallback"] > 0
    for s, a in zip(bounds, fitted):
        exact = solve_batched(gram[:, :s, :s], torch.ones(G, s, dtype=torch.bool), C, ridge=0.0).alpha.clamp_min(0.0)
        assert a.shape == (G, s) and (a - exact).abs().max() < 1e-5
    # refitted gates are written back: every gate is a view of one [G, B, N] tensor, zero past its boundary
    stacked = warm_fit.stacked_gates(fitted, N)
    assert stacked.shape == (G, len(bounds), N) and stacked.data_ptr() == fitted[0].data_ptr()
    padded = torch.stack([torch.nn.functional.pad(a, (0, N - a.shape[1])) for a in fitted], 1)
    assert torch.equal(stacked, padded)


def test_stacked_gates_of_unrelated_tensors_is_their_padded_stack():
    """Gates that are not views of one chain tensor are padded and stacked (a copy)."""
    from sv_attention.svdd import warm_fit

    fitted = [torch.rand(2, 3, dtype=torch.float64), torch.rand(2, 5, dtype=torch.float64)]
    stacked = warm_fit.stacked_gates(fitted, 6)
    assert stacked.shape == (2, 2, 6) and torch.equal(stacked[:, 0, :3], fitted[0])
    assert torch.equal(stacked[:, 1, :5], fitted[1]) and not bool(stacked[:, 0, 3:].any() or stacked[:, 1, 5:].any())
