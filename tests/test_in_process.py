"""A stage server and a trainer started in-process from the library, without the CLI: one server per stage and
one trainer train like the single-process reference, full state included (parameters and Adam moments)."""

import asyncio
import logging
import re

import pytest

from swarm import PeerSettings, RunSpec, ServerSession, Trainer, TrainerOptions
from swarm.protocol import ServerState
from swarm.reference import train_reference
from tests.conftest import write_spec
from tests.scenario import make_swarm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TOLERANCE = {"param": 1e-4, "exp_avg": 1e-3, "exp_avg_sq": 1e-3}
"""Relative distance (norm) to the reference's: the stages sum the micro-batches' gradients in another order."""


def _settings(tmp_path, cache_dir, name: str) -> PeerSettings:
    return PeerSettings(host="127.0.0.1", cache_dir=cache_dir, identity_file=tmp_path / "keys" / f"{name}.key",
                        fragment_dir=tmp_path / "fragments" / name, state_dir=tmp_path / "state" / name,
                        val_every_s=0)


async def _until(predicate, timeout: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.2)


MODES = {"synchronous": {}, "overlapped_rounds": {"overlap_rounds": True},
         "outer": {"mode": "outer", "inner_steps": 2},
         "outer_overlapped": {"mode": "outer", "inner_steps": 1, "overlap_rounds": True}}
STEPS = {"synchronous": 4, "overlapped_rounds": 3, "outer": 2, "outer_overlapped": 3}
"""Optimizer steps in four target batches: outer steps in the outer modes (the overlapped ones skip the first)."""
EPOCHS = {"outer": 2}


@pytest.mark.parametrize("mode", list(MODES))
def test_in_process_server_and_trainer_match_the_reference_state(mode, exact_spec_path, tmp_path, cache_dir,
                                                                 tiny_dataset, caplog):
    """Overlapped rounds: each epoch's gradients are applied at the end of the next (swarm.averaging.overlap), so
    four epochs take three steps, exactly as the reference with the same delay. Outer steps (DiLoCo,
    swarm.averaging.outer): two inner AdamW steps per outer SGD-Nesterov step, four inner steps make two epochs;
    the state is the outer parameters and momentum. Overlapped outer steps: each outer step applies the previous
    epoch's pseudo-gradient (DiLoCo's 0.7 and 0.9), and the inner parameters go on from the outer ones minus the
    pending pseudo-gradient, as the delayed reference's."""
    spec = RunSpec.from_toml(exact_spec_path)
    if MODES[mode]:
        spec = spec.updated(averaging=MODES[mode])
        write_spec(spec, exact_spec_path)
    samples = 4 * spec.training.target_batch_size  # four epochs, or four inner steps
    caplog.set_level(logging.INFO, logger="swarm.server.session")

    async def main(address: str):
        sessions = [ServerSession(address, _settings(tmp_path, cache_dir, f"server{k}"), stage=k)
                    for k in range(spec.model.num_stages)]
        runs = [asyncio.create_task(s.run()) for s in sessions]
        try:
            await _until(lambda: all(s.state == ServerState.ONLINE for s in sessions) or any(r.done() for r in runs),
                         180, "both servers online")
            trainer = Trainer(address, _settings(tmp_path, cache_dir, "trainer"),
                              TrainerOptions(share=0, concurrency=1, max_samples=samples))
            await asyncio.wait_for(trainer.run(), 300)
            states = [await asyncio.wait_for(s.served.server.compute(_state_and_module(s.served.optimizer)), 60)
                      for s in sessions]
            return trainer, states, [s.epoch for s in sessions]
        finally:
            for s in sessions:
                s.stop()
            await asyncio.wait_for(asyncio.gather(*runs), 120)  # a drain takes seconds; a hang says so here

    with make_swarm(exact_spec_path, tmp_path, cache_dir) as sw:
        sw.start_coordinator()
        trainer, states, epochs = asyncio.run(main(sw.address))

    joins = [r.getMessage() for r in caplog.records if "joined_s=" in r.getMessage()]
    assert len(joins) == 2, f"each server logs where its join went once (swarm.server.joinclock): {joins}"
    for line in joins:
        phases = {k: float(v) for k, v in re.findall(r"(\w+)_s=([\d.]+)", line)}
        assert phases["connect"] > 0 and phases["state"] > 0 and phases["joined"] > phases["connect"], line
    ref = train_reference(spec, tiny_dataset, share=0, max_samples=samples)
    steps, outer = STEPS[mode], mode.startswith("outer")
    assert trainer.samples == samples and epochs == [ref.epochs] * 2 == [EPOCHS.get(mode, 4)] * 2
    for k, ((state, inner), module) in enumerate(zip(states, ref.stages)):
        for name, p in module.named_parameters():
            shared = _outer(ref, p) if outer else p  # the stage's state: the outer parameters in the outer modes
            moments = ref.optimizer.state[shared]
            keys = ("momentum_buffer",) if outer else ("exp_avg", "exp_avg_sq")
            expected = {"param": shared.detach(), "inner": p.detach()} | {key: moments[key] for key in keys}
            for kind, value in expected.items():
                got = inner[name] if kind == "inner" else state[f"param/{name}" if kind == "param" else
                                                                 f"opt/{name}/{kind}"]
                rel = float((got - value).norm() / value.norm().clamp_min(1e-12))
                assert rel < TOLERANCE.get(kind, 1e-4), f"stage {k} {kind} of {name}: {rel:.2e} from the reference's"
            if not outer:
                assert float(state[f"opt/{name}/step"]) == float(moments["step"]) == steps
    if mode == "outer_overlapped":  # the delay moved the outer parameters: the inner ones hold the pending step
        moved = [float((_outer(ref, p) - p).detach().norm()) for m in ref.stages for p in m.parameters()]
        assert max(moved) > 1e-3, moved


def _state_and_module(optimizer):
    """On the compute thread: the server's stage state and its module's parameters (the inner ones in the outer
    modes), by name."""
    return lambda: (optimizer.state(), {n: p.detach().clone() for n, p in optimizer.module.named_parameters()})


def _outer(ref, p):
    """The reference's outer parameter that stands for inner parameter ``p``."""
    flat = [q for m in ref.stages for q in m.parameters()]
    outer = [q for group in ref.optimizer.param_groups for q in group["params"]]
    return outer[next(i for i, q in enumerate(flat) if q is p)]
