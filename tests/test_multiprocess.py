"""YAX under ``jax.distributed``: two processes with four CPU devices each.

Both processes run ``tests/multiprocess_worker.py`` on one 2 x 4 mesh of
all eight devices (the coordinator on localhost, its port picked free):
tracing and LoRA on global params, a sharded training step equal to the
same step on one device, adapters saved and loaded with orbax-checkpoint
(each process its own shards; a safetensors file, which would gather
them, is refused), and the same for QLoRA (``yax.quantize`` then
``yax.lora``). Each process checks its own results and says so.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKER = ROOT / 'tests' / 'multiprocess_worker.py'
PROCESSES = 2


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def test_two_processes_trace_lora_qlora_step_and_orbax_adapters(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env['XLA_FLAGS'] = (env.get('XLA_FLAGS', '') +
                      ' --xla_force_host_platform_device_count=4').strip()
  env['PYTHONPATH'] = os.pathsep.join(
      p for p in [str(ROOT), env.get('PYTHONPATH')] if p)
  port = free_port()
  procs = [subprocess.Popen(
      [sys.executable, str(WORKER), str(i), str(PROCESSES), str(port),
       str(tmp_path)], env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True) for i in range(PROCESSES)]
  outputs = []
  try:
    for proc in procs:
      outputs.append(proc.communicate(timeout=300)[0])
  finally:
    for proc in procs:  # a worker left waiting for its peer
      if proc.poll() is None:
        proc.kill()
        proc.communicate()
  for i, (proc, out) in enumerate(zip(procs, outputs)):
    shown = '\n'.join(l for l in out.splitlines() if '[Gloo]' not in l)
    assert proc.returncode == 0, f'worker {i}:\n{shown[-6000:]}'
    for line in ('equals one device', 'orbax adapters loaded',
                 'qlora step equals one device, adapters loaded',
                 f'worker {i} done'):
      assert line in out, f'worker {i} did not print {line!r}:\n{shown}'
