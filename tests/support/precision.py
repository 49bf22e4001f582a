"""bf16's precision as bounds on a training run: the first gradients, the weights after clipped
SGD, the logged losses and gradient norms.

bf16 keeps 8 significant bits: its unit roundoff is u = 2^-8 (round-to-nearest is off by at most
u relative). Autocast rounds each matmul's inputs and output (accumulating in float32); a gradient
of the tiny test models passes about k = 20 such roundings through 2 layers forward and back
(embedding; per layer norm, q/k/v, attention, o, norm, gate/up, down; norm, head; the same
backward). Independent rounding errors add in quadrature: sqrt(k) u = 4.5 u relative, norm-wise
over all gradients together, from float32's; twice that for margin: G = 9 u = 3.5%. Two bf16 runs
that round in different places (TSP's slices against one process's whole matrices) differ by
sqrt(2k) u = 6.3 u, inside G too. A gradient of the wrong scale or from the wrong data is off by
10% to 100%. Under clipped SGD each update is lr x clip x g/|g|: its error is at most the
gradient's twice (direction and norm), so the weights stay within 2 G of the movement, and the
logged losses and norms within 2 G at every step."""

from __future__ import annotations

U = 2.0 ** -8  # bf16's unit roundoff
G = 9 * U  # the first gradients' relative error bound (see above)


def relative_error(a: dict, b: dict, names=None) -> float:
    """||a - b|| / ||b|| over the named tensors (all of ``b``'s by default) together, in
    float64."""
    names = sorted(b) if names is None else names
    num = sum(((a[n].double() - b[n].double()) ** 2).sum() for n in names)
    den = sum((b[n].double() ** 2).sum() for n in names)
    return float((num / den).sqrt())


def assert_within_bf16(run: dict, ref: dict, init: dict, what: str, exact: dict | None = None,
                       first_gradients: bool = True, stored_bf16: bool = False) -> None:
    """``run`` (losses and norms per step, first gradients ``grads0`` and final ``weights`` by
    name) within bf16's bounds of ``ref`` (float32, or another bf16 run of the same global
    batches and clipped SGD steps, from the weights ``init``). ``first_gradients=False`` where a
    framework keeps them out of reach (DeepSpeed's buffers): the weights after clipped SGD then
    check their directions and the norms their sizes. ``stored_bf16``: the final weights are
    bf16 (rounded at the start and after each step, up to u |w| each, independent: within
    sqrt(steps + 1) u of |w| more). With ``exact`` (a float32 or float64 run), the run's first
    gradients must also be at least 0.1 u from it: the run computed in bf16 (a run that
    silently stayed in float32 would be ~1e-7 from it)."""
    names = sorted(ref["weights"])
    assert sorted(run["weights"]) == names, f"{what}: the weights' names differ"
    if first_gradients:
        assert sorted(run["grads0"]) == sorted(ref["grads0"]), f"{what}: gradients' names differ"
        grads = relative_error(run["grads0"], ref["grads0"])
        assert grads <= G, f"{what}: first gradients {grads / U:.2f} u from the reference's (> 9 u)"
    if exact is not None:
        off = relative_error(run["grads0"], exact["grads0"])
        assert off >= 0.1 * U, f"{what}: first gradients {off:.1e} from float's: not bf16"
    moved = relative_error(ref["weights"], init, names)
    weights = relative_error(run["weights"], ref["weights"], names)
    rounding = (len(ref["losses"]) + 1) ** 0.5 * U if stored_bf16 else 0.0
    assert weights <= 2 * G * moved + rounding, \
        f"{what}: weights {weights:.2e} from the reference's (> 2 G of its movement {moved:.2e})"
    for key in ("losses", "norms"):
        assert len(run[key]) == len(ref[key]) > 0, f"{what}: {key} {run[key]} vs {ref[key]}"
        for step, (a, b) in enumerate(zip(run[key], ref[key])):
            assert abs(a - b) <= 2 * G * abs(b), f"{what} step {step}: {key} {a} vs {b}"


def summary(run: dict, ref: dict, init: dict, exact: dict | None = None) -> str:
    """The figures :func:`assert_within_bf16` bounds, measured, for a test to print."""
    moved = relative_error(ref["weights"], init, sorted(ref["weights"]))
    out = [f"weights {relative_error(run['weights'], ref['weights']) / (G * moved):.3f} G of "
           f"the movement {moved:.2e}"]
    if "grads0" in run and "grads0" in ref:
        out.append(f"first gradients {relative_error(run['grads0'], ref['grads0']) / U:.2f} u")
    if exact is not None:
        out.append(f"{relative_error(run['grads0'], exact['grads0']) / U:.2f} u from float's")
    for key in ("losses", "norms"):
        worst = max(abs(a - b) / abs(b) for a, b in zip(run[key], ref[key]))
        out.append(f"{key} {worst / U:.3f} u")
    return ", ".join(out)
