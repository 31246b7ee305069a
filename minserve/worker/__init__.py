"""The worker: owns the device (model, KV pool, block copies, sampler) and runs a step."""

from minserve.worker.worker import StepPeers, Worker

__all__ = ["StepPeers", "Worker"]
