"""The CPU server: a stand-in for SGLang's HTTP server, speaking its protocol over transformers on CPU
(tests, CI and the CPU job): `python -m mgrpo.rollout.sglang.cpu.server`. It reads SGLang's protocol from
../protocol/ and imports nothing of our client (../), which launches it by module name.

- `server.py`    the command line (`sglang.launch_server`'s), the FastAPI app, the batching state
- `guard.py`     what stands before the routes: the key check and a body-size bound (ASGI middlewares)
- `auth.py`      SGLang's decision on a request's key (the wheel's rules, or the same written out)
- `receive.py`   a received request checked, a weight payload unpickled, the weight-update group joined
- `generate.py`  /generate: the body checked as SGLang checks it, and SGLang's answer
- `lora.py`      `--enable-lora`: adapters loaded by name (/load_lora_adapter*), applied to the requests naming them
- `model.py`     the model side: generation (the CPU engines' decode loop), weight loading, memory release
- `moe.py`       SGLang's weight names for a transformers MoE model
- `classify.py`  `--is-embedding`: a sequence classifier (reward model) served through /classify
- `text.py`      the tokenizer and grammar compiler, for the requests that need text
- `weights.py`   the weight-update routes, both transports, as an SGLang engine receives them
"""
