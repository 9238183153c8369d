import ast
import os
import re
import shutil
import tempfile
from typing import Any

import hypothesis
import jax
import jax.random as jr
import pytest


def _check_closures_only_where_they_name_arrays() -> None:
    """The package runs type-checked (`--jaxtyping-packages` in `pyproject.toml`):
    jaxtyping's import hook decorates every function the package defines. A closure
    is decorated anew each time its enclosing function runs, and beartype generates
    and compiles a checker each time: the closures of the hot paths, made per call
    and per trace, cost much of the suite's time. So closures are decorated only
    where an annotation names an array type (the checks that NumPy arrays do not
    leak into the traced program); every module-level function, class and method
    stays checked. `tests/test_collectives_sizes.py` took 77.6 s with every closure
    checked, 68.1 s so, 61.5 s with none. Applied only where the installed
    jaxtyping has the transformer as expected, with a bytecode cache of its own."""
    try:
        from jaxtyping import _import_hook as hook
    except ImportError:
        return
    transformer: Any = getattr(hook, "JaxtypingTransformer", None)
    typechecker: Any = getattr(hook, "Typechecker", None)
    if not (hasattr(transformer, "visit_FunctionDef") and typechecker is not None):
        return
    decorate = transformer.visit_FunctionDef
    get_hash = typechecker.get_hash

    def _holds_arrays(node: ast.FunctionDef) -> bool:
        # Annotated with an array type: the check that NumPy arrays do not leak.
        a = node.args
        annotations = [x.annotation for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
        return any(
            re.search(r"\b(Input)?Array\b", ast.unparse(t))
            for t in (*annotations, node.returns)
            if t is not None
        )

    def visit_FunctionDef(self: Any, node: ast.FunctionDef) -> Any:
        parents: list[ast.AST] | None = getattr(self, "_parents", None)
        functions = ast.FunctionDef | ast.AsyncFunctionDef
        if (
            parents is None
            or not any(isinstance(p, functions) for p in parents)
            or _holds_arrays(node)
        ):
            return decorate(self, node)
        # A closure without array annotations: visited, not decorated.
        parents.append(node)
        self.generic_visit(node)
        parents.pop()
        return node

    transformer.visit_FunctionDef = visit_FunctionDef
    typechecker.get_hash = lambda self: get_hash(self) + "arrayclosures"


_check_closures_only_where_they_name_arrays()


# Strict JAX, so that shape and dtype bugs cannot hide behind promotion.
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

hypothesis.settings.register_profile("dev", max_examples=25, deadline=None)
hypothesis.settings.register_profile(
    "ci", max_examples=40, deadline=None, print_blob=True
)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


_XLA_CACHE = "FILTERED_CHUNK_TESTS_XLA_CACHE"


def pytest_configure(config: pytest.Config) -> None:
    """XLA's persistent compilation cache, in a folder of this run's own for each
    worker: tests compile the same program again and again (an oracle, each
    size a budget measures, a new closure of the same function), and a worker
    then compiles it once (`tests/test_collectives_boundaries.py`: 150 s
    without, 134 s with). Per worker, so that no worker reads an entry another
    is still writing; removed when the run ends, so that every run compiles
    what it tests. JAX reports a program taken from the cache as a backend
    compilation too, so `helpers.count_compiles` counts it."""
    root = os.environ.get(_XLA_CACHE)
    if root is None:  # the run's first process: xdist's workers inherit it
        root = tempfile.mkdtemp(prefix="filtered-chunk-tests-xla-")
        os.environ[_XLA_CACHE] = root
        config.stash[_CACHE_ROOT] = root
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    jax.config.update("jax_compilation_cache_dir", os.path.join(root, worker))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


_CACHE_ROOT = pytest.StashKey[str]()


def pytest_unconfigure(config: pytest.Config) -> None:
    root = config.stash.get(_CACHE_ROOT, None)
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def getkey():
    """Returns a function that gives a fresh PRNG key on every call."""
    key = jr.key(0)

    def _getkey():
        nonlocal key
        key, subkey = jr.split(key)
        return subkey

    return _getkey


@pytest.fixture
def choices(monkeypatch) -> list[Any]:
    """Every chunk size a memory budget chooses while the test runs (under `grad`
    too): the one place every transform's call path searches."""
    # Imported here, after jaxtyping's import hook is installed (`pyproject.toml`).
    import filtered_chunk._wrapper

    found: list[Any] = []
    original = filtered_chunk._wrapper.choose_chunk_size

    def _spy(*args: Any, **kwargs: Any) -> Any:
        choice = original(*args, **kwargs)
        found.append(choice)
        return choice

    monkeypatch.setattr(filtered_chunk._wrapper, "choose_chunk_size", _spy)
    return found


@pytest.fixture(autouse=True)
def _budgets_by_the_model(monkeypatch):
    """Memory budgets choose by the speed model, not by timing, unless a test asks
    (`tests/test_budget_default.py` checks the default's timing), and store no
    timed choice on disk: every test's choice is its own."""
    import filtered_chunk._budget._timing as timing

    monkeypatch.setattr(timing, "BY_DEFAULT", False)
    monkeypatch.setenv("FILTERED_CHUNK_CACHE_DIR", "")
