"""Programs from JAX tutorials and articles, checkpointed end to end.

* the trees of JAX's "Working with pytrees" tutorial;
* the tutorial's MLP, trained straight through vs. checkpointed halfway and resumed in a fresh
  Python process;
* the linear regressor of the "JAX from PyTorch" article, checkpointed halfway and resumed;
* a JAX port of that article's LSTM language model's parameters, with a typed PRNG key in the
  training state, round-tripped with and without a ``jax.ShapeDtypeStruct`` template and resumed.

Resumed training must be bit-identical to straight-through training.
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
import textwrap
from collections import namedtuple
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import treestore
from tests.support.helpers import assert_tree_equal
from tests.support.templates import blank

# --------------------------------------------------------------------------------------------------
# helpers


def assert_bit_identical(a: Any, b: Any) -> None:
    """Same structure, and every leaf equal as raw bytes (compared as uint8 views)."""
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8))


# --------------------------------------------------------------------------------------------------
# "Working with pytrees": the tutorial's trees


def test_tutorial_tree_with_an_object_leaf_is_refused_and_nothing_is_written(tmp_path):
    url = tmp_path / "store"
    tree = [1, "a", object()]
    try:
        treestore.save(url, tree, "c")
    except treestore.errors.UnsupportedLeafError as exc:
        assert exc.address == "2"
        assert str(exc).startswith("2:")
        assert "object" in str(exc)
    else:
        raise AssertionError("saving an object() leaf should fail")
    checkpoints = url / "checkpoints"
    assert not checkpoints.exists() or not any(checkpoints.iterdir())
    assert treestore.Store(url).list() == []
    for sub in ("chunks", "manifests"):
        assert not (url / sub).exists() or not any(p.is_file() for p in (url / sub).rglob("*"))


def test_tutorial_trees_round_trip_exactly(tmp_path):
    url = tmp_path / "store"
    trees = [
        (1, (2, 3), ()),
        [1, {"k1": 2, "k2": (3, 4)}, 5],
        {"a": 2, "b": (2, 3)},
        jnp.array([1, 2, 3]),
    ]
    for i, tree in enumerate(trees):
        treestore.save(url, tree, f"tree-{i}")
    for i, tree in enumerate(trees):
        out = treestore.load(url, f"tree-{i}")
        assert_tree_equal(out, tree)
    # spelled out for the tutorial's first trees: ints stay ints, tuples stay tuples
    out = treestore.load(url, "tree-0")
    assert out == (1, (2, 3), ()) and type(out[1]) is tuple and type(out[2]) is tuple
    assert all(type(x) is int for x in jax.tree.leaves(out))
    out = treestore.load(url, "tree-3")
    assert isinstance(out, jax.Array) and out.dtype == jnp.int32 and out.tolist() == [1, 2, 3]


ATuple = namedtuple("ATuple", ("name"))


def test_tutorial_namedtuple_tree_addresses_follow_jax_order(tmp_path):
    url = tmp_path / "store"
    tree = [1, {"k1": 2, "k2": (3, 4)}, ATuple("foo")]
    treestore.save(url, tree, "c")
    manifest = treestore.Store(url).manifest("c")
    expected = [treestore.format_address(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    assert [leaf.address for leaf in manifest.leaves] == expected
    assert expected == ["0", "1/k1", "1/k2/0", "1/k2/1", "2/.name"]
    # without a template the namedtuple is a dict of its fields ...
    assert treestore.load(url, "c") == [1, {"k1": 2, "k2": (3, 4)}, {"name": "foo"}]
    # ... with one, it is an ATuple again
    out = treestore.load(url, "c", like=blank(tree))
    assert type(out[2]) is ATuple and out[2].name == "foo"
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    assert_tree_equal(out, tree)


# --------------------------------------------------------------------------------------------------
# "Working with pytrees": the tutorial's MLP, resumed in a fresh Python process

LEARNING_RATE = 1e-4
MLP_STEPS = 1000  # total; the checkpoint is taken after MLP_STEPS // 2 (the whole test takes ~5 s)


def init_mlp_params(layer_widths: list[int], seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.RandomState(seed)
    params = []
    for n_in, n_out in itertools.pairwise(layer_widths):
        params.append(
            dict(
                weights=rng.normal(size=(n_in, n_out)) * np.sqrt(2 / n_in),
                biases=np.ones(shape=(n_out,)),
            )
        )
    return params


def mlp_forward(params: Any, x: Any) -> Any:
    *hidden, last = params
    for layer in hidden:
        x = jax.nn.relu(x @ layer["weights"] + layer["biases"])
    return x @ last["weights"] + last["biases"]


def mlp_loss_fn(params: Any, x: Any, y: Any) -> Any:
    return jnp.mean((mlp_forward(params, x) - y) ** 2)


@jax.jit
def mlp_update(params: Any, x: Any, y: Any) -> Any:
    grads = jax.grad(mlp_loss_fn)(params, x, y)
    return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)


def mlp_data(seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(seed)
    xs = rng.normal(size=(128, 1))
    ys = xs**2
    return xs, ys


def mlp_train(params: Any, steps: int) -> Any:
    xs, ys = mlp_data()
    for _ in range(steps):
        params = mlp_update(params, xs, ys)
    return params


RESUME_SCRIPT = """
import importlib.util, sys
import jax
import treestore

spec = importlib.util.spec_from_file_location("tutorial_programs", {module!r})
programs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(programs)

url, steps = {url!r}, {steps!r}
params = treestore.load(url, "half")
assert isinstance(params, list) and all(type(layer) is dict for layer in params), params
assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(params))
params = programs.mlp_train(params, steps)
treestore.save(url, params, "resumed")
print("resumed", treestore.Store(url).manifest("resumed").leaves[0].address)
"""


def test_tutorial_mlp_resumed_in_a_fresh_process_is_bit_identical(tmp_path):
    url = str(tmp_path / "store")
    params = init_mlp_params([1, 128, 128, 1])
    xs, ys = mlp_data()
    half = MLP_STEPS // 2
    params = mlp_train(params, half)
    treestore.save(url, params, "half")
    straight = mlp_train(params, MLP_STEPS - half)
    assert float(mlp_loss_fn(straight, xs, ys)) < float(
        mlp_loss_fn(init_mlp_params([1, 128, 128, 1]), xs, ys)
    )

    script = tmp_path / "resume.py"
    script.write_text(textwrap.dedent(RESUME_SCRIPT).format(module=__file__, url=url, steps=MLP_STEPS - half))
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resumed 0/biases" in done.stdout

    resumed = treestore.load(url, "resumed")
    # (jax.tree.map rebuilds dicts with sorted keys, so trained layers read biases, weights)
    assert type(resumed) is list and [list(layer) for layer in resumed] == [["biases", "weights"]] * 3
    assert_bit_identical(resumed, straight)
    assert_tree_equal(resumed, straight)


# --------------------------------------------------------------------------------------------------
# "JAX from PyTorch": the linear regressor


def linreg_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(42)
    xs = rng.normal(size=(100,))
    noise = rng.normal(scale=0.1, size=(100,))
    ys = xs * 3 - 1 + noise
    return xs, ys


def linreg_forward(params: Any, x: Any) -> Any:
    return params["w"] * x + params["b"]


def linreg_loss_fn(params: Any, x: Any, y: Any) -> Any:
    err = linreg_forward(params, x) - y
    return jnp.mean(jnp.square(err))


linreg_grad_fn = jax.grad(linreg_loss_fn)


def update_combiner(p: Any, g: Any) -> Any:
    return p - 0.05 * g


def linreg_train(params: Any, steps: int) -> Any:
    xs, ys = linreg_data()
    for _ in range(steps):
        grads = linreg_grad_fn(params, xs, ys)
        params = jax.tree.map(update_combiner, params, grads)
    return params


def test_article_linear_regressor_resumed_is_bit_identical(tmp_path):
    url = tmp_path / "store"
    steps = 100
    params = {"w": 13.0, "b": 0.0}
    treestore.save(url, params, "step-0")
    start = treestore.load(url, "step-0")
    assert start == {"w": 13.0, "b": 0.0} and all(type(v) is float for v in start.values())

    half = linreg_train(start, steps // 2)
    treestore.save(url, half, "step-50")
    straight = linreg_train(half, steps - steps // 2)

    loaded = treestore.load(url, "step-50")
    assert_tree_equal(loaded, half)
    resumed = linreg_train(loaded, steps - steps // 2)
    assert_bit_identical(resumed, straight)
    assert_tree_equal(resumed, straight)
    assert math.isclose(float(straight["w"]), 3.0, abs_tol=0.1)
    assert math.isclose(float(straight["b"]), -1.0, abs_tol=0.1)
    # the template path gives the same result
    resumed_like = linreg_train(treestore.load(url, "step-50", like=blank(half)), steps - steps // 2)
    assert_bit_identical(resumed_like, straight)


# --------------------------------------------------------------------------------------------------
# "JAX from PyTorch": the LSTM language model's parameters, ported to JAX

VOCAB, EMBED, HIDDEN = 43, 17, 32


def init_lstm_params(key: jax.Array) -> dict[str, Any]:
    k = jax.random.split(key, 6)
    bound = 1 / math.sqrt(HIDDEN)

    def uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
        return jax.random.uniform(key, shape, minval=-bound, maxval=bound)

    return {
        "embeddings": jax.random.normal(k[0], (VOCAB, EMBED)),
        "c_0": jnp.zeros((HIDDEN,)),
        "h_0": jnp.zeros((HIDDEN,)),
        "cell": {
            "weight_ih": uniform(k[1], (4 * HIDDEN, EMBED)),
            "weight_hh": uniform(k[2], (4 * HIDDEN, HIDDEN)),
            "bias": uniform(k[3], (4 * HIDDEN,)),
        },
        "output": {"weight": uniform(k[4], (VOCAB, HIDDEN)), "bias": uniform(k[5], (VOCAB,))},
    }


def lstm_loss(params: Any, tokens: jax.Array) -> jax.Array:
    """Next-token cross-entropy of one batch of token sequences, shape (batch, time)."""
    cell = params["cell"]

    def step(carry: Any, x: jax.Array) -> Any:
        h, c = carry
        gates = x @ cell["weight_ih"].T + h @ cell["weight_hh"].T + cell["bias"]
        i, f, g, o = jnp.split(gates, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), h

    batch = tokens.shape[0]
    h0 = jnp.broadcast_to(params["h_0"], (batch, HIDDEN))
    c0 = jnp.broadcast_to(params["c_0"], (batch, HIDDEN))
    xs = params["embeddings"][tokens[:, :-1]].swapaxes(0, 1)  # (time, batch, embed)
    _, hs = jax.lax.scan(step, (h0, c0), xs)
    logits = hs @ params["output"]["weight"].T + params["output"]["bias"]
    targets = tokens[:, 1:].swapaxes(0, 1)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


@jax.jit
def lstm_sgd_step(state: dict[str, Any]) -> dict[str, Any]:
    rng, sub = jax.random.split(state["rng"])
    tokens = jax.random.randint(sub, (8, 12), 0, VOCAB)
    grads = jax.grad(lstm_loss)(state["params"], tokens)
    params = jax.tree.map(lambda p, g: p - 0.5 * g, state["params"], grads)
    return {"params": params, "rng": rng}


def lstm_train(state: dict[str, Any], steps: int) -> dict[str, Any]:
    for _ in range(steps):
        state = lstm_sgd_step(state)
    return state


def test_article_lstm_params_round_trip_with_and_without_a_template(tmp_path):
    url = tmp_path / "store"
    params = init_lstm_params(jax.random.key(0))
    treestore.save(url, params, "init")

    out = treestore.load(url, "init")
    assert_tree_equal(out, params)
    assert list(out) == ["embeddings", "c_0", "h_0", "cell", "output"]
    assert out["embeddings"].shape == (43, 17)
    assert out["cell"]["weight_ih"].shape == (4 * HIDDEN, EMBED)
    assert out["cell"]["weight_hh"].shape == (4 * HIDDEN, HIDDEN)

    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    like = treestore.load(url, "init", like=template)
    assert jax.tree_util.tree_structure(like) == jax.tree_util.tree_structure(params)
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(like))
    assert_bit_identical(like, params)

    # a template that disagrees is refused, naming the address
    bad = dict(template, h_0=jax.ShapeDtypeStruct((HIDDEN + 1,), jnp.float32))
    try:
        treestore.load(url, "init", like=bad)
    except treestore.StructureMismatchError as exc:
        assert any(p.startswith("h_0:") for p in exc.problems), exc.problems
    else:
        raise AssertionError("a template of the wrong shape should be refused")


def test_article_lstm_training_resumed_is_bit_identical(tmp_path):
    url = tmp_path / "store"
    state = {"params": init_lstm_params(jax.random.key(0)), "rng": jax.random.key(1)}
    state = lstm_train(state, 3)
    treestore.save(url, state, "step-3")
    straight = lstm_train(state, 3)

    plain = treestore.load(url, "step-3")
    assert_tree_equal(plain, state)
    resumed = lstm_train(plain, 3)
    assert_tree_equal(resumed, straight)

    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    resumed_like = lstm_train(treestore.load(url, "step-3", like=template), 3)
    assert_tree_equal(resumed_like, straight)
    for a, b in zip(
        jax.tree.leaves(resumed_like["params"]), jax.tree.leaves(straight["params"]), strict=True
    ):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    rng_entry = treestore.Store(url).manifest("step-3").leaves[-1]
    assert (rng_entry.address, rng_entry.kind) == ("rng", "prng_key")
