"""Prefill/decode disaggregation and capacity planning (docs/distributed.md).

- `costs.py`, `calibrate.py`: step times measured on the real engine, fitted to a line.
- `workload.py`, `simulator.py`, `planner.py`: a discrete-event simulator of prefill,
  decode and colocated instances that predicts TTFT, TPOT and goodput, and a search over
  the prefill:decode ratio and TP degree (DistServe's question at cluster scale).
- `kv_transfer.py`, `transfer_rule.py`, `pd_pair.py`: one prefill process hands finished
  prefills' KV blocks to one decode process over torch.distributed send/recv.
- `proxy_engine.py` (with `topology`, `cluster`, `prefill_instance`, `decode_instance`,
  `token_deltas`, `placement`, `instance_stats`, `fault_recovery`): the streaming proxy
  over P prefill and D decode processes that `minserve serve --disaggregation 1P2D` serves
  through; streams resume elsewhere when an instance dies.
- `stage_planner.py`, `migration.py`, `migration_control.py`: live migration of decoding
  requests between decode instances by multi-stage pre-copy (Llumnix), and draining.
"""
