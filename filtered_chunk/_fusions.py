"""What XLA's count of a compiled CPU program leaves out: the buffers its YNNPACK
fusions keep (on by default since jax 0.10), which `memory_analysis()` does not
see, read off the fused computations in the compiled program's text.

A YNNPACK fusion computes its output in tiles, and most of its values are never
whole: `jax.vmap` of a pairwise kernel keeps none of the `[2048, 8192, 64]` values
it fuses, where the same program compiled with the fusions off allocates all
4 GiB of one. What a run of such programs allocates (measured on XLA's CPU
backend of jax 0.10 and 0.12, `tests/test_budget_fusions.py`) shows what a fusion
keeps whole, and what is counted here:

- the operands of a dot or convolution made inside the fusion: an MLP fused whole,
  the activations passed from one matrix product to the next;
- the operand of a reduction over the leading axis whose result is broadcast back
  (a softmax over the batch): every tile needs all of it;
- a reduction's result used inside the fusion, whole at most.

A fusion's buffers are freed when it has run: two fused MLPs one after the other
allocate 120-132 MiB where each keeps 128 MiB, so a program keeps the most that
one of its fusions keeps, not their sum.

A fusion that uses a dot's or a convolution's result further can keep more than
that, so there the budget also compiles the program with the fusions off, where
XLA allocates, and counts, what its own emitters need, and counts the larger
(`_budget/_program.py`). (Even that can fall short: a product against a large
operand, then a sum over its rows, allocated 111 MiB where this reads none and
the fusions off count 66 MiB.) A fusion that is one product, as most of an MLP's
are, keeps nothing beyond XLA's count.
"""

import dataclasses
import functools as ft
import re


_YNN_FUSION = '"__ynn_fusion"'  # the fusion kind in the compiled HLO's text
_MADE_OUTSIDE = ("parameter", "constant", "broadcast", "iota")
_PASSES_ON = ("reduce", "dot", "convolution")  # ops a broadcast back is not seen past
_ITEM_BYTES = {"pred": 1}
_SHAPE = re.compile(r"\b([a-z]+)(\d*)(?:e\w+)?\[([\d,]*)\](?:\{([\d,]*)[^}]*\})?")
_HEAD = re.compile(r"^(ROOT )?%?([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")


@dataclasses.dataclass(frozen=True)
class Uncounted:
    """The bytes a compiled program's YNNPACK fusions keep beyond XLA's count, as
    estimated above, and whether one of them uses a dot's or a convolution's
    result further (`dots`: then counted with the fusions off too)."""

    bytes: int
    dots: bool


@dataclasses.dataclass(frozen=True)
class _Op:
    root: bool
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attributes: str


def _bytes(shape: str) -> int:
    """The bytes of an array or tuple shape (`f32[2,3]{1,0}`); unknown types as 8."""
    total = 0
    for kind, bits, dims, _ in _SHAPE.findall(shape):
        size = _ITEM_BYTES.get(kind) or (-(-int(bits) // 8) if bits else 8)
        for d in filter(None, dims.split(",")):
            size *= int(d)
        total += size
    return total


def _leading(shape: str) -> int:
    """The major-most dimension of an array shape (its layout's last entry)."""
    match = _SHAPE.search(shape)
    layout = match.group(4) if match else None
    return int(layout.split(",")[-1]) if layout else 0


def _op(line: str) -> tuple[str, _Op] | None:
    head = _HEAD.match(line)
    if head is None:
        return None
    root, name, shape, opcode, rest = head.groups()
    depth, end = 1, len(rest)
    for i, c in enumerate(rest):
        depth += (c == "(") - (c == ")")
        if depth == 0:
            end = i
            break
    operands = tuple(re.findall(r"%([\w.\-]+)", rest[:end]))
    return name, _Op(bool(root), shape, opcode, operands, rest[end:])


def _computations(text: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        head = None if line.startswith(" ") else _COMPUTATION.match(line)
        if head is not None:
            name = head.group(1)
            found[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            found[name].append(line.strip())
    return found


def _kept(ops: dict[str, _Op]) -> int:
    """The bytes one fusion keeps (above)."""
    users: dict[str, list[str]] = {}
    for name, op in ops.items():
        for operand in op.operands:
            users.setdefault(operand, []).append(name)

    def made_inside(name: str) -> bool:
        return name in ops and ops[name].opcode not in _MADE_OUTSIDE

    @ft.cache  # a value can reach a user by many paths
    def broadcast_back(name: str) -> bool:
        for user in users.get(name, []):
            opcode = ops[user].opcode
            if opcode == "broadcast" or (
                opcode not in _PASSES_ON and broadcast_back(user)
            ):
                return True
        return False

    kept: set[str] = set()
    for name, op in ops.items():
        inside = [x for x in op.operands if made_inside(x)]
        if op.opcode in ("dot", "convolution"):
            kept.update(inside)
        elif op.opcode == "reduce" and not op.root:
            kept.add(name)
            dims = re.search(r"dimensions=\{([\d,]*)\}", op.attributes)
            reduced = {int(d) for d in dims.group(1).split(",") if d} if dims else set()
            source = inside[:1]
            if source and _leading(ops[source[0]].shape) in reduced:
                kept.update(source if broadcast_back(name) else [])
    return sum(_bytes(ops[name].shape) for name in kept)


def uncounted(text: str) -> Uncounted | None:
    """What the YNNPACK fusions of a compiled program (its HLO `text`) keep beyond
    XLA's count, the most of any one (above); `None` where it has none. A fusion
    this cannot read counts as `dots` (then also counted with the fusions off)."""
    if _YNN_FUSION not in text:
        return None
    computations = _computations(text)
    total, dots = 0, False
    for lines in computations.values():
        for line in lines:
            if _YNN_FUSION not in line:
                continue
            called = re.search(r"calls=%?([\w.\-]+)", line)
            body = computations.get(called.group(1), []) if called else []
            ops = dict(filter(None, map(_op, body)))
            if not ops:
                dots = True
                continue
            dots = dots or any(
                op.opcode in ("dot", "convolution") and not op.root
                for op in ops.values()
            )
            total = max(total, _kept(ops))
    return Uncounted(total, dots)
