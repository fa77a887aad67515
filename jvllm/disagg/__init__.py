"""Disaggregated prefill: the proxy in front of a prefill and a decode server
(`proxy`). The KV transfer between them is `jvllm.kv_offload.socket_transfer`'s."""
