"""Probes a linear map with a transpose of its own, as the staged engine's loops
would need it to keep stage boundaries cheaply under `jax.grad` (issue 25).

    python benchmarks/accumulating_transpose.py    # checks, then a table (~30 s)

`cotangent_reads.py` shows where the memory of a buffer that several loops read
goes under `jax.grad`: each reader's cotangent of it is a batch-sized buffer of
its own, all alive at once. A reader whose backward loop adds its cotangent chunk
by chunk into the one the later readers accumulated needs one. There it was a
`jax.custom_vjp`, which ends forward mode; the library's loops must keep `jax.jvp`,
`jax.vmap` and second derivatives. This probe builds the reader as the library
builds its loop, a custom JVP rule, whose tangent map is one primitive, `_linear_p`:
a linear map (a closed jaxpr of residuals and linear inputs) bound with its
transpose (another), with JVP, transpose and batching rules. JAX's
`jax.custom_derivatives.linear_call` has the first two but no batching rule.

It checks the readers against plain JAX's (each a `lax.scan` with checkpointed
steps that reads the buffer as a scanned input) under `jax.grad`, `jax.jit`,
`jax.jvp`, `jax.vmap` of `jax.grad`, `jax.hessian` (along one scalar scaling the
inputs and the weights) and the gradient of a gradient, then prints XLA's
temporaries and the time under `jax.grad` for `n` readers of one 4 MiB buffer. It
uses JAX internals (`jax.interpreters`), as the library confines them to
`filtered_chunk/_jax_compat.py`; nothing here is library code.
"""

import jax
import jax.extend.core as jex
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
from _measure import compile_fn, median_seconds, MIB
from cotangent_reads import chunk, D, K, N, relative_difference, scanned
from jax.interpreters import ad, batching, mlir


# --- the primitive: a linear map bound with its transpose ------------------------


def _impl(*args, callee, transpose, num_res):
    del transpose, num_res
    return jex.jaxpr_as_fun(callee)(*args)


def _abstract_eval(*args, callee, transpose, num_res):
    del args, transpose, num_res
    return callee.out_avals


_linear_p = jex.Primitive("fc_probe_linear")
_linear_p.multiple_results = True
_linear_p.def_impl(_impl)
_linear_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(_linear_p, mlir.lower_fun(_impl, multiple_results=True))


def _instantiate(tangent, aval):
    if type(tangent) is ad.Zero:
        return jnp.zeros(aval.shape, aval.dtype)
    return tangent


def _specs(avals):
    # Shapes and dtypes to trace a transpose with: its cotangents' values never
    # matter, so none are made.
    return [
        jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals
    ]


def _jvp(primals, tangents, *, callee, transpose, num_res):
    # Linear in the linear inputs: their tangents go through the map itself (so a
    # reverse pass of a reverse pass keeps the transpose); the residuals' own
    # tangents, where there are any, through JAX's JVP of the map.
    params = dict(callee=callee, transpose=transpose, num_res=num_res)
    out = _linear_p.bind(*primals, **params)
    avals = callee.in_avals
    lin = [_instantiate(t, a) for t, a in zip(tangents[num_res:], avals[num_res:])]
    tangent_out = _linear_p.bind(*primals[:num_res], *lin, **params)
    if any(type(t) is not ad.Zero for t in tangents[:num_res]):
        res_t = [_instantiate(t, a) for t, a in zip(tangents[:num_res], avals)]
        lin_zeros = [jnp.zeros(a.shape, a.dtype) for a in avals[num_res:]]
        _, extra = jax.jvp(
            jex.jaxpr_as_fun(callee), tuple(primals), (*res_t, *lin_zeros)
        )
        tangent_out = [a + b for a, b in zip(tangent_out, extra)]
    return out, tangent_out


def _transpose(cts, *args, callee, transpose, num_res):
    res = args[:num_res]
    assert not any(ad.is_undefined_primal(r) for r in res)
    cts = [_instantiate(c, a) for c, a in zip(cts, callee.out_avals)]
    out = _linear_p.bind(
        *res, *cts, callee=transpose, transpose=callee, num_res=num_res
    )
    return [None] * num_res + list(out)


def _batch(args, dims, *, callee, transpose, num_res):
    # Every linear input and output batched (a transpose's outputs must match its
    # inputs'), residuals as they come; both jaxprs batched alike.
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)

    def front(x, d):
        if d is None:
            return jnp.broadcast_to(x, (size, *jnp.shape(x)))
        return jnp.moveaxis(x, d, 0)

    res_axes = [None if d is None else 0 for d in dims[:num_res]]
    res = [x if d is None else front(x, d) for x, d in zip(args, dims[:num_res])]
    lin = [front(x, d) for x, d in zip(args[num_res:], dims[num_res:])]

    def batched(jaxpr, operands):
        in_axes = (*res_axes, *([0] * (len(jaxpr.in_avals) - num_res)))
        fun = jax.vmap(jex.jaxpr_as_fun(jaxpr), in_axes=in_axes)
        return jax.make_jaxpr(fun)(*res, *operands)

    callee_b = batched(callee, lin)
    transpose_b = batched(transpose, _specs(callee_b.out_avals))
    out = _linear_p.bind(
        *res, *lin, callee=callee_b, transpose=transpose_b, num_res=num_res
    )
    return out, [0] * len(out)


ad.primitive_jvps[_linear_p] = _jvp
ad.primitive_transposes[_linear_p] = _transpose
batching.primitive_batchers[_linear_p] = _batch


def linear_call(fun, fun_transpose, residuals, linear):
    """`fun(residuals, linear)`, linear in `linear`, whose transpose is
    `fun_transpose(residuals, cotangents)`. Flat tuples of arrays throughout."""
    callee = jax.make_jaxpr(lambda *a: fun(a[: len(residuals)], a[len(residuals) :]))(
        *residuals, *linear
    )
    transpose = jax.make_jaxpr(
        lambda *a: fun_transpose(a[: len(residuals)], a[len(residuals) :])
    )(*residuals, *_specs(callee.out_avals))
    return _linear_p.bind(
        *residuals, *linear, callee=callee, transpose=transpose, num_res=len(residuals)
    )


# --- the reader: a loop over chunks of `b`, passing `b` on -----------------------


def _tangent(residuals, linear):
    # The reader's tangent map, one chunk at a time, plus `b`'s tangent passed on.
    b, w = residuals
    t_b, t_w = linear
    chunks, t_chunks = b.reshape(-1, K, D), t_b.reshape(-1, K, D)

    def body(acc, xs):
        rows, t_rows = xs
        return acc + jax.jvp(chunk, (rows, w), (t_rows, t_w))[1], None

    return lax.scan(body, jnp.zeros((), b.dtype), (chunks, t_chunks))[0], t_b


def _tangent_transpose(residuals, cotangents):
    # Backward: the reader's cotangent of `b` added chunk by chunk into the later
    # readers' (`ct_b`), carried through the loop and so updated in place.
    b, w = residuals
    ct_y, ct_b = cotangents
    chunks = b.reshape(-1, K, D)

    def body(j, carry):
        acc, ct_w = carry
        rows = lax.dynamic_index_in_dim(chunks, j, keepdims=False)
        ct_rows, ct_wj = jax.vjp(chunk, rows, w)[1](ct_y)
        old = lax.dynamic_index_in_dim(acc, j, keepdims=False)
        acc = lax.dynamic_update_index_in_dim(acc, old + ct_rows, j, 0)
        return acc, ct_w + ct_wj

    init = (ct_b.reshape(chunks.shape), jnp.zeros_like(w))
    acc, ct_w = lax.fori_loop(0, chunks.shape[0], body, init)
    return acc.reshape(b.shape), ct_w


@jax.custom_jvp
def reader(b, w):
    """`scanned(b, w)` and `b`, passed on to the next reader."""
    return scanned(b, w), b


@reader.defjvp
def _reader_jvp(primals, tangents):
    t_y, t_b = linear_call(_tangent, _tangent_transpose, primals, tangents)
    return reader(*primals), (t_y, t_b)


def _loss(n, accumulating):
    def loss(x, ws):
        b = jnp.tanh(x)
        total = jnp.zeros((), x.dtype)
        for i in range(n):
            if accumulating:
                y, b = reader(b, ws[i])
            else:
                y = scanned(b, ws[i])
            total = total + y
        return total

    return loss


def _checks() -> None:
    n = 3
    x, ws = jr.normal(jr.key(0), (N, D)), jr.normal(jr.key(1), (n, D, D)) / 10
    ours, plain = _loss(n, True), _loss(n, False)
    grad = lambda f: jax.grad(f, argnums=(0, 1))
    tx, tws = jr.normal(jr.key(2), x.shape), jr.normal(jr.key(3), ws.shape)
    jvp = lambda f: jax.jvp(f, (x, ws), (tx, tws))
    xs = jr.normal(jr.key(4), (3, N, D))
    vmap_grad = lambda f: jax.vmap(jax.grad(f), in_axes=(0, None))(xs, ws)
    # `jax.hessian` in a scalar `s` scaling both the inputs and the weights.
    hess = lambda f: jax.hessian(lambda s: f(s * x, s * ws))(jnp.asarray(0.7))
    # Reverse over reverse: the gradient of a gradient's norm.
    rr = lambda f: jax.grad(lambda w: jnp.sum(jax.grad(f)(x, w) ** 2))(ws)
    cases = {
        "grad": lambda f: grad(f)(x, ws),
        "jit(grad)": lambda f: jax.jit(grad(f))(x, ws),
        "jvp": jvp,
        "vmap(grad)": vmap_grad,
        "hessian": hess,
        "grad of grad": rr,
    }
    for name, case in cases.items():
        difference = relative_difference(case(ours), case(plain))
        print(f"{name}: largest difference {difference:.1e} (relative)")
        assert difference < 1e-4, name


def main() -> None:
    _checks()
    print()
    print("| readers of B | plain JAX MiB | accumulating MiB | plain ms | acc. ms |")
    print("| --- | --- | --- | --- | --- |")
    x = jr.normal(jr.key(0), (N, D))
    for n in (1, 2, 4, 8):
        ws = jr.normal(jr.key(1), (n, D, D)) / 10
        row = []
        for accumulating in (False, True):
            grad = jax.grad(_loss(n, accumulating), argnums=(0, 1))
            compiled = compile_fn(grad, x, ws)
            seconds = median_seconds(compiled.executable, x, ws, repeats=5)
            row.append((compiled.temp_bytes / MIB, seconds * 1e3))
        (pm, pt), (am, at) = row
        print(f"| {n} | {pm:.1f} | {am:.1f} | {pt:.1f} | {at:.1f} |")


if __name__ == "__main__":
    main()
