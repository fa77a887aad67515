"""KV cache accounting on the host: which blocks each request holds, where they live.

`block_pool` (free blocks and the prefix cache's hashed full blocks), `prefix` (the
block hash and what a lookup finds), `kv_cache_manager`
(allocation, forks, copy-on-write, swap and the host tier for the scheduler),
`block_table_array` (every running request's table as one int32 array row),
`swap_space` (host blocks of swapped-out requests), `host_tier` (evicted prefix blocks
kept in host memory). No device arrays: the runner owns the KV cache itself.
"""
