"""The GPT and how it is cut into pipeline stages."""

from swarm.model.gpt import StageModule, build_stage, lm_loss

__all__ = ["StageModule", "build_stage", "lm_loss"]
