"""Beyond one device: tensor parallelism on torch.distributed (docs/distributed.md).

`LLM(tensor_parallel_size=N)` starts it (`launcher.py`); the layers are in `layers.py`
and `vocab.py`, the sharded model in `shard_model.py`, the per-step broadcast in
`step_message.py`, the workers in `worker.py`.
"""
