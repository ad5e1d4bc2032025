"""Every function torch lets a tensor subclass override (``torch.overrides.get_overridable_functions()``),
applied to a sharded parameter and to its gradient: each gives one process's answer or raises
``ShardwiseError`` naming it; none returns a per-rank partial result, none crashes with another error.

Each function is called the way the first of a few argument patterns that works on a plain tensor in one
process calls it (the tensor alone, with a second tensor of its shape, a dimension, a scalar, in a list...):
the same call with the piece (and pieces for the second tensor) must then return the same values, the whole
tensor where it returns a tensor (a piece is compared as the whole it stands for), or raise ShardwiseError.
Where no pattern works in one process, the piece must raise too. A few calls that change the tensor object
itself (hooks, ``requires_grad_``, storage and metadata setters) are not walked: they have their own rules
(shard_param.py, pieces.py) and rows in test_torch_apis.py.
"""

from __future__ import annotations

import math
import warnings

import torch

from harness import run_distributed

# Calls about the tensor object, not its values (see the module docstring), and the autograd entry points
# (test_torch_apis.py rows: backward(inputs=), autograd.grad).
_NOT_WALKED = {"register_hook", "register_post_accumulate_grad_hook", "requires_grad_", "retain_grad", "detach_",
               "share_memory_", "__setstate__", "set_", "resize_", "resize_as_", "backward", "_backward_hooks",
               "_post_accumulate_grad_hooks", "grad", "_grad", "data", "requires_grad", "__reduce_ex__",
               "__deepcopy__", "storage", "untyped_storage", "_typed_storage", "pin_memory", "record_stream",
               "cuda", "xpu", "ipu", "mtia", "to_sparse", "__dlpack__", "__dlpack_device__", "module_load",
               "_make_subclass", "_make_wrapper_subclass", "as_subclass", "name", "volatile", "grad_fn", "_grad_fn",
               "_base", "_cdata", "output_nr", "retains_grad", "_version", "is_leaf", "grad_dtype", "__torch_function__",
               "__setitem__", "__delitem__", "apply_", "map_", "map2_", "__array_wrap__", "__array__", "new",
               "_nested_tensor_from_mask", "__dir__", "__sizeof__", "__iter__"}


def _name(func) -> str:
    if getattr(func, "__name__", None) in ("__get__", "__set__"):  # a property: its own name
        return getattr(func.__self__, "__name__", str(func))
    return getattr(func, "__name__", None) or str(func)


_UNINITIALISED = {"empty_like", "new_empty", "new_empty_strided", "empty_strided"}  # values compared: none


def _patterns(t, u):
    """Argument lists to try, ``t`` the tensor under test and ``u`` a second one of its shape."""
    return [(t,), (t, u), (t, 0), (t, 2.0), (t, u, u), (t, 0, True), (t, u, 0.5), ([t, u],), ([t, u], 0), (u, t)]


def _close(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point() or a.is_complex():
            return torch.allclose(a.detach().to(torch.complex128 if a.is_complex() else torch.float64),
                                  b.detach().to(torch.complex128 if b.is_complex() else torch.float64),
                                  rtol=1e-4, atol=1e-6, equal_nan=True)
        return torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6) or (math.isnan(a) and math.isnan(b))
    return a == b


def _wholes(out):
    """A result with every piece replaced by the whole tensor it stands for (an agreed gather)."""
    from shardwise.engine.surface.pieces import Piece, whole_of

    if isinstance(out, Piece):
        return whole_of(out, "the walk's comparison")
    if isinstance(out, (tuple, list)) and not isinstance(out, torch.Size):
        return type(out)(_wholes(o) for o in out) if not hasattr(out, "_fields") else tuple(_wholes(o) for o in out)
    return out


def _walk(rank: int, ws: int) -> dict:
    import shardwise
    from shardwise.engine.surface.pieces import local_of
    from torch.overrides import get_overridable_functions

    torch.manual_seed(0)
    whole = torch.nn.Linear(5, 6, bias=False)  # 30 elements: 15 on each rank
    reference_weight = whole.weight.detach().clone()
    model = shardwise.shard(torch.nn.Sequential(whole), units=None)
    p = model[0].weight
    x = torch.randn(4, 5)
    model(x).sum().backward()
    reference_grad = x.new_ones(4, 6).t() @ x  # d(sum(x W^T))/dW
    saved = local_of(p).detach().clone()
    functions = [f for fs in get_overridable_functions().values() for f in fs if _name(f) not in _NOT_WALKED]
    results = {"exact": 0, "refused": 0, "both raise": 0, "failures": []}
    for subject in ("parameter", "gradient"):
        for func in functions:
            name = f"{subject}: {_name(func)}"
            outcome = _one(func, subject, p, reference_weight, reference_grad, saved)
            if outcome in ("exact", "refused", "both raise"):
                results[outcome] += 1
            else:
                results["failures"].append(f"{name}: {outcome}")
    return results


def _one(func, subject: str, p, reference_weight, reference_grad, saved) -> str:
    from shardwise import ShardwiseError
    from shardwise.engine.surface.pieces import local_of

    grad_mode = subject == "parameter"
    plain = torch.nn.Parameter(reference_weight.clone()) if grad_mode else reference_grad.clone()
    expected, pattern = None, None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, args in enumerate(_patterns(plain, reference_weight.clone() * 0.5 + 0.25)):
            try:
                torch.manual_seed(1)  # (random functions draw the same numbers in both runs)
                with torch.set_grad_enabled(grad_mode):
                    expected = func(*args)
                pattern = i
                break
            except Exception:  # noqa: BLE001 - this pattern does not fit the function: try the next
                plain = torch.nn.Parameter(reference_weight.clone()) if grad_mode else reference_grad.clone()
        t = p if grad_mode else p.grad.clone()
        u = p.detach().clone() * 0.5 + 0.25
        args = _patterns(t, u)[pattern if pattern is not None else 0]
        try:
            torch.manual_seed(1)
            with torch.set_grad_enabled(grad_mode):
                got = func(*args)
            got = _wholes(got)
        except ShardwiseError:
            return "refused"
        except Exception as e:  # noqa: BLE001 - compared with one process below
            if pattern is None:
                return "both raise"
            return f"raised {type(e).__name__}: {str(e)[:300]} (one process returned a value)"
        finally:
            with torch.no_grad():
                local_of(p).copy_(saved)
            p.requires_grad_(True)
    if pattern is None:
        return f"returned {type(got).__name__} where one process raises for every pattern"
    expected = _wholes(expected)
    if _name(func) in _UNINITIALISED:
        got, expected = (got.shape, got.dtype), (expected.shape, expected.dtype)
    return "exact" if _close(got, expected) else f"differs: {str(got)[:200]} vs one process's {str(expected)[:200]}"


def test_every_overridable_torch_function_on_a_parameter_and_a_gradient_is_exact_or_refused_by_name():
    results = run_distributed(_walk, 2, timeout_s=120)
    for rank, r in enumerate(results):
        assert not r["failures"], f"rank {rank}: {len(r['failures'])} failures:\n" + "\n".join(r["failures"][:40])
    r = results[0]
    walked = r["exact"] + r["refused"] + r["both raise"]
    assert r["exact"] > 500 and r["refused"] > 100, r  # (the walk reaches the table: most calls compute)
    assert walked > 2000, r
