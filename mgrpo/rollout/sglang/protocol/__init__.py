"""SGLang's protocol, as both our client (..) and the CPU server (../cpu/) speak it; imports nothing else of
rollout/sglang/.

- `tables.py`    what we know without the wheel (sglang 0.5.23): request fields, sampling fields, memory
                 tags, which routes take which key, the globals a weight payload may hold
- `wheel.py`     SGLang's own code read from the installed wheel: request classes, the /generate JSON
                 contract, the unpickler and process-group maker, the key rules, the --config merger
- `buckets.py`   flattened weight buckets as SGLang lays them out (both senders, the CPU server's receiver)
- `group.py`     the weight-update process group, made the way SGLang makes its side
"""
