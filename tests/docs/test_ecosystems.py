"""What flax, equinox, optax, orbax and Hugging Face users do on day one, each in their own idiom.

Every test saves values that are not the template's (templates come from a fresh init with another
seed, from ``eval_shape``, or from tests/support/templates.py), so a load that handed back the template
instead of reading the store fails.
"""

from __future__ import annotations

import logging
import os
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from click.testing import CliRunner

import treestore
from tests.support.counting import CountingFileSystem
from tests.support.helpers import assert_tree_equal, same_bytes
from treestore_cli.main import cli

equinox = pytest.importorskip("equinox")
nnx = pytest.importorskip("flax.nnx")
linen = pytest.importorskip("flax.linen")
optax = pytest.importorskip("optax")
ocp = pytest.importorskip("orbax.checkpoint")
safetensors_numpy = pytest.importorskip("safetensors.numpy")
from flax.training import train_state  # noqa: E402
from safetensors import safe_open  # noqa: E402


def memory() -> str:
    return f"memory://treestore-tests/{uuid.uuid4().hex}"


def close(a: object, b: object) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


# --- flax nnx ------------------------------------------------------------------------------------
class NnxModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.l2 = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(nnx.relu(self.bn(self.l1(x))))


def test_nnx_state_restores_into_an_abstract_model():
    model = NnxModel(nnx.Rngs(0))
    model.bn.mean[...] = jnp.arange(8.0)  # batch statistics are state too
    url = memory()
    treestore.save(url, nnx.state(model), "step-1")
    abstract = nnx.eval_shape(lambda: NnxModel(nnx.Rngs(1)))
    graphdef, abstract_state = nnx.split(abstract)
    restored = nnx.merge(graphdef, treestore.load(url, like=abstract_state))
    x = jnp.ones((3, 4))
    restored.eval(), model.eval()
    assert np.allclose(restored(x), model(x))
    assert np.array_equal(restored.bn.mean[...], np.arange(8.0))


def test_nnx_params_only_for_fine_tuning():
    """nnx.state(model, nnx.Param) is a subset of the saved state: partial=True loads it, and
    reads the chunks of those leaves only."""
    model = NnxModel(nnx.Rngs(0))
    model.stats = nnx.BatchStat(jnp.full((256, 256), 2.0))  # 256 KiB that fine-tuning never reads
    url = "counting://" + uuid.uuid4().hex
    treestore.save(url, nnx.state(model), "pretrained")
    fresh = NnxModel(nnx.Rngs(5))
    params = nnx.state(fresh, nnx.Param)
    with pytest.raises(treestore.StructureMismatchError) as info:
        treestore.load(url, like=params)
    assert "stats/.value: unexpected" in str(info.value) and "pass partial=True" in str(info.value)
    CountingFileSystem.reset()
    loaded = treestore.load(url, like=params, partial=True)
    assert CountingFileSystem.bytes_read("/chunks/") < 64 * 1024  # not the statistics
    assert np.array_equal(loaded["l2"]["kernel"][...], model.l2.kernel[...])
    assert jax.tree.structure(loaded) == jax.tree.structure(params)


def test_nnx_partial_load_updates_the_model():
    model = NnxModel(nnx.Rngs(0))
    url = memory()
    treestore.save(url, nnx.state(model), "pretrained")
    fresh = NnxModel(nnx.Rngs(5))
    params = treestore.load(url, like=nnx.state(fresh, nnx.Param), partial=True)
    nnx.update(fresh, params)
    assert np.array_equal(fresh.l1.kernel[...], model.l1.kernel[...])
    assert np.array_equal(fresh.bn.scale[...], model.bn.scale[...])
    missing = nnx.state(NnxModel(nnx.Rngs(0)), nnx.Param)
    missing["extra"] = nnx.Param(jnp.zeros(3))
    with pytest.raises(treestore.StructureMismatchError, match=r"extra/\.value: missing"):
        treestore.load(url, like=missing, partial=True)  # partial never excuses a missing leaf


# --- flax linen + optax: TrainState ---------------------------------------------------------------
class Dense(linen.Module):
    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return linen.Dense(3)(x)


def _train_state(seed: int) -> train_state.TrainState:
    module = Dense()
    params = module.init(jax.random.key(seed), jnp.ones((1, 2)))["params"]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    return train_state.TrainState.create(apply_fn=module.apply, params=params, tx=tx)


@jax.jit
def _train_step(state: train_state.TrainState) -> train_state.TrainState:
    grads = jax.tree.map(jnp.ones_like, state.params)
    return state.apply_gradients(grads=grads)


def test_linen_resume_into_train_state_create():
    """The standard resume: save after jitted steps (step is an int32 array), restore into
    TrainState.create(...) (step is the Python int 0)."""
    state = _train_step(_train_step(_train_state(0)))
    url = memory()
    treestore.save(url, state, "step-2")
    fresh = _train_state(1)
    with pytest.raises(
        treestore.StructureMismatchError,
        match=r"\.step: expected Python int, found array int32\[\] \(pass cast=True to convert\)",
    ):
        treestore.load(url, like=fresh)
    restored = treestore.load(url, like=fresh, cast=True)
    assert type(restored) is train_state.TrainState and restored.step == 2 and type(restored.step) is int
    assert close(restored.params, state.params) and close(restored.opt_state, state.opt_state)
    assert close(_train_step(restored).params, _train_step(state).params)  # training goes on


def test_linen_python_step_into_an_abstract_state():
    """The reverse: a state saved right after create (step 0, a Python int) restores into
    jax.eval_shape(...) of it, whose step is an int32 ShapeDtypeStruct."""
    state = _train_state(0)
    url = memory()
    treestore.save(url, state, "init")
    abstract = jax.eval_shape(lambda: _train_state(1))
    with pytest.raises(treestore.StructureMismatchError, match=r"\.step: .*pass cast=True"):
        treestore.load(url, like=abstract)
    restored = treestore.load(url, like=abstract, cast=True)
    assert isinstance(restored.step, jax.Array) and restored.step.dtype == jnp.int32
    assert int(restored.step) == 0 and restored.step.weak_type == abstract.step.weak_type
    assert close(restored.params, state.params)


def test_optax_states_round_trip_through_a_fresh_init():
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(optax.adamw)(learning_rate=3e-4),
        optax.add_decayed_weights(1e-4),
    )
    opt_state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    for _ in range(3):
        _, opt_state = tx.update(grads, opt_state, params)
    url = memory()
    treestore.save(url, opt_state, "opt")
    restored = treestore.load(url, like=tx.init(jax.tree.map(jnp.zeros_like, params)))
    assert jax.tree.structure(restored) == jax.tree.structure(opt_state)
    assert_tree_equal(restored, jax.tree.map(lambda x: x, opt_state))  # dict keys in jax's order
    a, _ = tx.update(grads, restored, params)
    b, _ = tx.update(grads, opt_state, params)
    assert close(a, b)


# --- equinox --------------------------------------------------------------------------------------
def test_equinox_whole_model_restore():
    """eqx.filter(model, eqx.is_array) is saved; load(like=model) takes the arrays from the store
    and the activation functions (and Dropout's rate and flag) from like, as
    eqx.tree_deserialise_leaves does."""
    eqx = equinox
    model = [eqx.nn.MLP(2, 3, 8, 2, key=jax.random.key(0)), eqx.nn.Dropout(0.25)]
    url = memory()
    treestore.save(url, eqx.filter(model, eqx.is_array), "mlp")
    like = [eqx.nn.MLP(2, 3, 8, 2, key=jax.random.key(1)), eqx.nn.Dropout(0.25)]
    restored = treestore.load(url, like=like)
    x = jnp.ones(2)
    assert np.allclose(restored[0](x), model[0](x))
    assert restored[0].activation is like[0].activation and restored[1].p == 0.25
    abstract = eqx.filter_eval_shape(eqx.nn.MLP, 2, 3, 8, 2, key=jax.random.key(1))
    assert np.allclose(treestore.load(url, like=[abstract, like[1]])[0](x), model[0](x))


def test_equinox_saving_the_whole_model_names_every_function():
    eqx = equinox
    model = {"mlp": eqx.nn.MLP(2, 3, 8, 2, key=jax.random.key(0)), "lr": np.float32(0.1)}
    with pytest.raises(treestore.errors.UnsupportedLeafError) as info:
        treestore.save(memory(), model, "mlp")
    text = str(info.value)
    assert "2 leaves cannot be stored" in text
    assert "mlp/.activation" in text and "mlp/.final_activation" in text
    assert "eqx.filter(model, eqx.is_array)" in text
    assert isinstance(info.value, TypeError) and info.value.address == "mlp/.activation"


def test_equinox_hint_for_a_model_in_a_dict_whose_keys_do_not_sort():
    """The hint finds an equinox module under a dict whose keys do not sort (1 and "a"), which
    jax's own walk of the tree cannot order."""
    model = {"mlp": equinox.nn.MLP(2, 3, 8, 2, key=jax.random.key(0)), 0: np.float32(0.1)}
    with pytest.raises(treestore.errors.UnsupportedLeafError, match=r"eqx.filter\(model, eqx.is_array\)"):
        treestore.save(memory(), model, "mlp")


def test_equinox_arrays_are_never_taken_from_like():
    """A stored None where like has an array is a missing leaf, not a value to keep: the
    template's array would come back as if it had been saved."""
    eqx = equinox
    model = eqx.nn.Linear(2, 3, key=jax.random.key(0))
    url = memory()
    treestore.save(url, eqx.tree_at(lambda m: m.bias, model, None), "no-bias")
    with pytest.raises(treestore.StructureMismatchError, match=r"\.bias: missing.*holds None there"):
        treestore.load(url, like=model)


# --- orbax ----------------------------------------------------------------------------------------
def _orbax_tree(seed: int = 0) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    return {
        "params": {"dense": {"kernel": rng.standard_normal((2, 3)).astype(np.float32)}},
        "opt": [np.arange(3, dtype=np.int32), np.float32(0.5)],
        "step": np.int32(7),
    }


def _orbax_manager(root: str, steps: tuple[int, ...]) -> None:
    options = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min")
    with ocp.CheckpointManager(root, options=options) as mgr:
        for step in steps:
            mgr.save(
                step,
                args=ocp.args.StandardSave(_orbax_tree(step)),
                metrics={"loss": 1.0 / step},
                custom_metadata={"run": "r1"},
            )
        mgr.wait_until_finished()


def test_orbax_standard_checkpointer_by_relative_path(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "orbax_ckpt", _orbax_tree())
    absl = logging.getLogger("absl")
    before = absl.level
    with caplog.at_level(logging.INFO):
        caplog.clear()
        r = treestore.import_file("orbax_ckpt", "./s#x")
        assert not [rec for rec in caplog.records if rec.name == "absl"]  # orbax kept quiet
    assert absl.level == before
    assert r.name == "x" and r.leaves == 4
    assert_tree_equal(treestore.load("s#x")["params"], _orbax_tree()["params"])
    assert treestore.import_file("orbax_ckpt", "s").name == "orbax_ckpt"


def test_orbax_import_and_export_on_the_command_line(tmp_path, monkeypatch):
    """`treestore -q import orbax_ckpt ./s#x` by relative path prints the result only; `export
    --format orbax` writes a folder orbax restores."""
    monkeypatch.chdir(tmp_path)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "orbax_ckpt", _orbax_tree())
    result = CliRunner().invoke(cli, ["-q", "import", "orbax_ckpt", "./s#x"])
    assert result.exit_code == 0, result.output
    assert result.stderr == "" and result.stdout.startswith("imported orbax_ckpt as ")
    result = CliRunner().invoke(cli, ["-q", "export", "s#x", "back", "--format", "orbax"])
    assert result.exit_code == 0 and result.stderr == "", result.output
    with ocp.StandardCheckpointer() as checkpointer:
        back = checkpointer.restore(tmp_path / "back")
    assert same_bytes(back["params"]["dense"]["kernel"], _orbax_tree()["params"]["dense"]["kernel"])


def test_orbax_checkpoint_manager_steps(tmp_path):
    root = str(tmp_path / "mgr")
    _orbax_manager(root, (3, 5))
    url = memory()
    for folder in ("mgr/5/default", "mgr/5"):
        r = treestore.import_file(tmp_path / folder, url, overwrite=True)
        assert r.name == "step-000000005"
        meta = treestore.open(url, r.name).metadata
        assert meta["step"] == 5 and meta["metrics"] == {"loss": 0.2}
        assert meta["source"]["format"] == "orbax" and meta["source"]["custom_metadata"] == {"run": "r1"}
    other = memory()
    assert treestore.import_file(root, other).name == "step-000000005"  # the root: its newest step
    assert treestore.import_file(tmp_path / "mgr" / "3", other).name == "step-000000003"
    manager = treestore.CheckpointManager(other)  # a treestore manager resumes from it
    assert manager.steps() == [3, 5] and manager.info(3).metrics == {"loss": 1 / 3}
    restored = manager.restore()
    assert_tree_equal(restored["params"], _orbax_tree(5)["params"])
    manager.close()


def test_export_to_orbax_restores_in_orbax(tmp_path):
    tree = _orbax_tree(1)
    url = memory()
    tree["ema"] = jnp.arange(3.0)  # jax arrays go to orbax as jax arrays, numpy ones as numpy
    treestore.save(url, {**tree, "epoch": 3, "done": False}, "c")
    out = tmp_path / "exported"
    e = treestore.export_file(f"{url}#c", out, format="orbax")
    assert (e.format, e.tensors) == ("orbax", 7)
    with ocp.StandardCheckpointer() as checkpointer:
        plain = checkpointer.restore(out)
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), tree)
        typed = checkpointer.restore(out, {**target, "epoch": 0, "done": True})
    assert same_bytes(plain["params"]["dense"]["kernel"], tree["params"]["dense"]["kernel"])
    assert plain["epoch"] == 3 and plain["done"] is False
    assert isinstance(plain["step"], np.ndarray) and same_bytes(typed["step"], tree["step"])
    assert isinstance(typed["ema"], jax.Array) and same_bytes(typed["ema"], tree["ema"])
    assert same_bytes(typed["opt"][0], tree["opt"][0])
    with pytest.raises(treestore.InvalidInputError, match="exists"):
        treestore.export_file(f"{url}#c", out, format="orbax")
    treestore.save(url, {"w": np.ones(2)}, "d")
    treestore.export_file(f"{url}#d", out, overwrite=True)  # an existing folder is orbax
    with ocp.StandardCheckpointer() as checkpointer:
        assert list(checkpointer.restore(out)) == ["w"]
    assert sorted(os.listdir(tmp_path)) == ["exported"]  # no temporary folder left


def test_orbax_round_trip_keeps_the_step_and_custom_metadata(tmp_path):
    _orbax_manager(str(tmp_path / "mgr"), (4,))
    url = memory()
    treestore.import_file(tmp_path / "mgr", url)
    (tmp_path / "back" / "4").mkdir(parents=True)
    treestore.export_file(url, tmp_path / "back" / "4" / "default", format="orbax")
    with ocp.CheckpointManager(tmp_path / "back") as mgr:  # orbax sees step 4 in the new folder
        assert mgr.latest_step() == 4
        restored = mgr.restore(4, args=ocp.args.StandardRestore())
    assert_tree_equal(restored["params"], _orbax_tree(4)["params"])
    with ocp.StandardCheckpointer() as checkpointer:
        assert checkpointer.metadata(tmp_path / "back" / "4" / "default").custom_metadata == {"run": "r1"}
    again = treestore.import_file(tmp_path / "back" / "4", memory())
    assert again.name == "step-000000004"


def test_export_to_orbax_refuses_what_orbax_cannot_hold(tmp_path):
    url = memory()
    treestore.save(url, {"w": np.ones(2), "tag": "v1", "key": jax.random.key(0)}, "c")
    with pytest.raises(treestore.InvalidInputError) as info:
        treestore.export_file(url, tmp_path / "o", format="orbax")
    assert "tag: a Python str cannot go in an orbax checkpoint" in str(info.value)
    assert "key: PRNG keys cannot be exported" in str(info.value)
    assert not os.listdir(tmp_path)


# --- Hugging Face safetensors ---------------------------------------------------------------------
def test_safetensors_file_comes_back_with_its_metadata(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "model.embed_tokens.weight": rng.standard_normal((16, 4)).astype(np.float16),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((4, 4)).astype(np.float32),
        "lm_head.weight": rng.standard_normal((16, 4)).astype(np.float32),
    }
    f = tmp_path / "model.safetensors"
    safetensors_numpy.save_file(tensors, f, metadata={"format": "pt", "model": "tiny"})
    url = memory()
    treestore.import_file(f, url)
    loaded = treestore.load(url, "model")
    assert same_bytes(
        loaded["model"]["layers"]["0"]["self_attn"]["q_proj"]["weight"],
        tensors["model.layers.0.self_attn.q_proj.weight"],
    )
    out = tmp_path / "back.safetensors"
    treestore.export_file(f"{url}#model", out)
    with safe_open(out, framework="np") as back:
        assert back.metadata() == {"format": "pt", "model": "tiny"}
        assert sorted(back.keys()) == sorted(tensors)
        assert all(same_bytes(back.get_tensor(k), v) for k, v in tensors.items())


# --- day-one API edges ----------------------------------------------------------------------------
def test_diff_takes_url_name_pairs():
    url = memory()
    treestore.save(url, {"w": np.zeros(3)}, "a")
    treestore.save(url, {"w": np.ones(3)}, "b")
    d = treestore.diff((url, "a"), (url, "b"))
    assert d.changed == ("w",)
    assert not treestore.diff((url, "a"), f"{url}#a")


def test_a_mistyped_name_gets_suggestions(tmp_path):
    url = str(tmp_path / "s")
    for name in ("step-100", "step-200", "best"):
        treestore.save(url, {"x": 1}, name)
    for call in (
        lambda: treestore.load(url, "stpe-100"),
        lambda: treestore.open(f"{url}#stpe-100"),
        lambda: treestore.diff(f"{url}#step-100", (url, "stpe-100")),
        lambda: treestore.Store(url).delete("stpe-100"),
    ):
        with pytest.raises(treestore.errors.CheckpointNotFoundError) as info:
            call()
        assert (
            str(info.value)
            == f"no checkpoint 'stpe-100' in store {url} (did you mean 'step-100' or 'step-200'?)"
        )
        assert info.value.checkpoint == "stpe-100"
    with pytest.raises(
        treestore.errors.CheckpointNotFoundError, match=r"no checkpoint 'zzz' in store [^(]*\Z"
    ):
        treestore.load(url, "zzz")


def test_one_wording_for_a_store_that_is_not_there(tmp_path):
    missing = str(tmp_path / "nothing")
    calls = {
        "load": lambda: treestore.load(missing),
        "load a name": lambda: treestore.load(missing, "m"),
        "diff": lambda: treestore.diff(f"{missing}#m", f"{missing}#n"),
        "latest": lambda: treestore.Store(missing).latest(),
    }
    for what, call in calls.items():
        with pytest.raises(treestore.errors.CheckpointNotFoundError) as info:
            call()
        assert str(info.value).startswith(f"no treestore store at {missing}"), what
    assert not os.path.exists(missing)
    empty = memory()
    treestore.save(empty, {"x": 1}, "gone")
    treestore.Store(empty).delete("gone")  # a store without checkpoints is still a store
    with pytest.raises(treestore.errors.CheckpointNotFoundError, match=r"\Ano checkpoints in store "):
        treestore.load(empty)
    with pytest.raises(treestore.errors.CheckpointNotFoundError, match=r"'m' in store .*no checkpoints"):
        treestore.load(empty, "m")


def test_manager_restore_takes_cast_and_partial(tmp_path):
    """A linen-style resume through the manager: the saved step is a Python int, the template's a
    0-d int32 array; and a template covering part of the checkpoint."""
    import jax
    import jax.numpy as jnp

    with treestore.CheckpointManager(str(tmp_path / "run"), async_save=False) as mgr:
        mgr.save(3, {"step": 3, "params": {"w": np.arange(4.0, dtype=np.float32)}, "opt": np.ones(2)})
        like = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": {"w": jnp.zeros(4)}}
        out = mgr.restore(like, cast=True, partial=True)
    assert int(out["step"]) == 3 and out["step"].dtype == jnp.int32
    np.testing.assert_array_equal(out["params"]["w"], np.arange(4.0, dtype=np.float32))
    with pytest.raises(treestore.StructureMismatchError, match="partial=True"):
        treestore.CheckpointManager(str(tmp_path / "run")).restore(like, cast=True)
