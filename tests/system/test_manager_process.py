"""Resuming exactly after a real process dies: a training subprocess is killed with SIGKILL (or
asked to stop with SIGTERM) mid-run and resumed in another; the final state must be bit-identical
to an uninterrupted run's.

Run as ``python -m tests.system.test_manager_process URL TOTAL [--delay S] [--preemption]`` this module
is that training program: the MLP of JAX's pytrees tutorial, trained with optax's adam on minibatches
drawn with a ``jax.random.key``, checkpointed every 100 steps (keeping the last 3), resumed from the
newest checkpoint when there is one. It prints ``step N`` after each step, ``committed N`` when a
checkpoint becomes visible, ``resumed N``, ``preempted N`` and ``done``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parents[1]
TOTAL = 600
EVERY = 100


# -- the training program -----------------------------------------------------------------------
def init_mlp_params(layer_widths: list[int], key: Any) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp

    params = []
    for n_in, n_out in itertools.pairwise(layer_widths):
        key, sub = jax.random.split(key)
        params.append(
            {
                "weights": jax.random.normal(sub, (n_in, n_out)) * jnp.sqrt(2 / n_in),
                "biases": jnp.ones((n_out,)),
            }
        )
    return params


def forward(params: list[dict[str, Any]], x: Any) -> Any:
    import jax

    *hidden, last = params
    for layer in hidden:
        x = jax.nn.relu(x @ layer["weights"] + layer["biases"])
    return x @ last["weights"] + last["biases"]


def train(url: str, total: int, delay: float, preemption: bool) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import treestore
    from tests.support.templates import blank

    xs = jnp.asarray(np.random.default_rng(0).normal(size=(256, 1)), jnp.float32)
    ys = xs**2
    tx = optax.adam(1e-3)

    def loss_fn(params: Any, x: Any, y: Any) -> Any:
        return jnp.mean((forward(params, x) - y) ** 2)

    @jax.jit
    def train_step(state: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        key, sub = jax.random.split(state["key"])
        idx = jax.random.choice(sub, xs.shape[0], (32,), replace=False)
        loss, grads = jax.value_and_grad(loss_fn)(state["params"], xs[idx], ys[idx])
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state, "key": key}, loss

    init_key, key = jax.random.split(jax.random.key(0))
    params = init_mlp_params([1, 32, 32, 1], init_key)
    state = {"params": params, "opt_state": tx.init(params), "key": key}
    with treestore.CheckpointManager(
        url, save_every_steps=EVERY, retention=treestore.Retention(keep_last=3), preemption=preemption
    ) as m:
        start = m.latest_step()
        if start is None:
            start = 0
            m.save(0, state)
        else:
            # a template without the data: the resumed state can only come from the store
            state = m.restore(like=blank(state))
            print("resumed", start, flush=True)
        committed = start
        for step in range(start + 1, total + 1):
            state, loss = train_step(state)
            m.save(step, state, metrics={"loss": loss})
            if m.reached_preemption(step):
                print("preempted", step, flush=True)
                return
            if step % 10 == 0 and (latest := m.latest_step()) != committed:
                committed = latest
                print("committed", latest, flush=True)
            print("step", step, flush=True)
            time.sleep(delay)
    print("done", flush=True)


# -- the tests ----------------------------------------------------------------------------------
def command(url: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tests.system.test_manager_process", url, str(TOTAL), *extra]


ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}


def run(url: str) -> str:
    done = subprocess.run(command(url), cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "done" in done.stdout
    return done.stdout


def final_state(url: str) -> Any:
    import treestore

    m = treestore.CheckpointManager(url)
    assert m.latest_step() == TOTAL
    return m.restore()


def run_until(url: str, pattern: str, then: signal.Signals, *extra: str) -> tuple[int, str]:
    """Start training, send ``then`` when a line matches ``pattern``; (exit code, output)."""
    proc = subprocess.Popen(
        command(url, *extra), cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if re.fullmatch(pattern, line.strip()):
                proc.send_signal(then)
                break
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, "".join(lines) + out + err


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("uninterrupted") / "store")
    run(url)
    return final_state(url)


def test_sigkill_mid_run_then_resume_is_bit_identical(tmp_path, uninterrupted):
    from tests.support.helpers import assert_tree_equal

    url = str(tmp_path / "store")
    # Kill as soon as a checkpoint past step 0 is visible; the run is far from its end.
    code, out = run_until(url, r"committed [1-9]\d*", signal.SIGKILL, "--delay", "0.005")
    assert code == -signal.SIGKILL, out
    assert "done" not in out
    last = max(int(s) for s in re.findall(r"^step (\d+)$", out, re.M))
    assert last < TOTAL
    resumed = run(url)
    start = int(re.search(r"resumed (\d+)", resumed).group(1))
    assert start >= EVERY and start % EVERY == 0
    assert_tree_equal(final_state(url), uninterrupted)


def test_sigterm_saves_at_the_next_step_exits_cleanly_and_resumes(tmp_path, uninterrupted):
    import treestore
    from tests.support.helpers import assert_tree_equal

    url = str(tmp_path / "store")
    code, out = run_until(url, r"step 150", signal.SIGTERM, "--delay", "0.005", "--preemption")
    assert code == 0, out
    stopped = int(re.search(r"preempted (\d+)", out).group(1))
    assert stopped > 150
    assert treestore.CheckpointManager(url).latest_step() == stopped  # saved off the interval
    resumed = run(url)
    assert f"resumed {stopped}" in resumed
    assert_tree_equal(final_state(url), uninterrupted)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("total", type=int)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--preemption", action="store_true")
    args = parser.parse_args()
    train(args.url, args.total, args.delay, args.preemption)


if __name__ == "__main__":
    main()
