"""The scripts in examples/ run end to end (``--small``) and report success.

Each example checks itself against plain JAX/Flax or Hugging Face and prints
the result; these tests run them as a user would (a subprocess) and read
those lines.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / 'examples'
PNG_MAGIC = b'\x89PNG\r\n\x1a\n'


def run_example(name: str, *args: str, timeout: int = 600) -> str:
  env = dict(os.environ, USE_TORCH='0', USE_FLAX='1', TF_CPP_MIN_LOG_LEVEL='3')
  env['PYTHONPATH'] = os.pathsep.join(
      p for p in [str(ROOT), env.get('PYTHONPATH')] if p)
  proc = subprocess.run([sys.executable, str(EXAMPLES / name), *args],
                        capture_output=True, text=True, timeout=timeout,
                        env=env, cwd=ROOT)
  assert proc.returncode == 0, (
      f'{name} exited with {proc.returncode}\n--- stdout\n{proc.stdout}'
      f'\n--- stderr\n{proc.stderr[-4000:]}')
  return proc.stdout


def find(pattern: str, text: str) -> re.Match:
  m = re.search(pattern, text)
  assert m, f'no line matching {pattern!r} in:\n{text}'
  return m


def test_lora_finetune_small(tmp_path):
  for module in ('optax', 'sklearn', 'matplotlib', 'tqdm'):
    pytest.importorskip(module)
  png = tmp_path / 'curve.png'
  out = run_example('lora_finetune.py', '--small', '--out', str(png))

  m = find(r'trainable parameters: ([\d,]+) of ([\d,]+)', out)
  trainable, total = (int(g.replace(',', '')) for g in m.groups())
  assert 0 < trainable < total / 5

  m = find(r'accuracy on 5-9: before ([\d.]+) -> after ([\d.]+)', out)
  before, after = map(float, m.groups())
  assert before < 0.1  # the pretrained head never predicts 5-9
  assert after > 0.85 and after > before + 0.5

  m = find(r'LoRA model at init equals the original: max \|logit diff\| = '
           r'([\d.e+-]+)', out)
  assert float(m.group(1)) < 1e-5  # B = 0 at init (exactly 0 on CPU)
  find(r'frozen weights bit-identical after training: True', out)
  find(r'every adapter weight changed: True', out)
  m = find(r'merged params on the original mox give the same predictions: '
           r'True \(max \|logit diff\| = ([\d.e+-]+)\)', out)
  assert float(m.group(1)) < 1e-4

  assert f'loss curve saved to {png}' in out
  data = png.read_bytes()
  assert data.startswith(PNG_MAGIC)
  from PIL import Image  # matplotlib depends on Pillow
  with Image.open(png) as image:
    image.verify()
  with Image.open(png) as image:
    assert image.format == 'PNG' and min(image.size) > 100


def test_relu_to_gelu_small():
  pytest.importorskip('transformers')
  out = run_example('relu_to_gelu.py', '--small')
  for model in ('ResNet', 'BERT'):
    m = find(rf'{model}: replaced (\d+) ReLU with GELU \((\d+) left\)', out)
    replaced, left = map(int, m.groups())
    assert replaced > 0 and left == 0
    m = find(rf'{model}: max abs difference vs HF with GELU: ([\d.e+-]+) '
             r'\(vs the original ReLU model: ([\d.e+-]+)\)', out)
    diff, moved = map(float, m.groups())
    assert diff < 1e-5  # the rewrite matches HF's own GELU model
    assert moved > 1e-3  # ... and it did change the model
  # ResNet's ReLUs see several shapes: one traced GELU per shape.
  m = find(r'ResNet: .*, (\d+) input shape\(s\)', out)
  assert int(m.group(1)) > 1


def test_gelu_swap_small(tmp_path):
  for module in ('transformers', 'optax'):
    pytest.importorskip(module)
  page = tmp_path / 'grouped.html'
  out = run_example('gelu_swap.py', '--steps', '2', '--html', str(page))
  m = find(r'found (\d+) exact GELUs', out)
  assert int(m.group(1)) == 3  # one per layer of the small BERT
  find(r'XPath //module_call\[@name="gelu"\] selects 3 nodes', out)
  m = find(r'grouped tree evaluates like the original: max \|diff\| = '
           r'([\d.e+-]+)', out)
  assert float(m.group(1)) == 0.0
  assert page.read_text(encoding='utf-8').startswith('<!doctype html>')
  m = find(r'tanh swap vs HF gelu_new BERT: max \|diff\| = ([\d.e+-]+) '
           r'\(original exact-GELU BERT: ([\d.e+-]+)\)', out)
  new, old = map(float, m.groups())
  assert new < 1e-5 and old > 1e-4
  find(r'fewbit swap: 3 custom_vjp_call equations, 0 exact GELUs left', out)
  m = find(r'max \|diff\| = ([\d.e+-]+) \(largest gradient ([\d.e+-]+)\); '
           r'vs the true GELU gradients: ([\d.e+-]+)', out)
  diff, scale, true_diff = map(float, m.groups())
  assert diff <= 1e-5 * scale and true_diff > 1e-3 * scale
  m = find(r'fine-tuning losses: ([\d.]+) -> ([\d.]+)', out)
  assert float(m.group(2)) < float(m.group(1))
  m = find(r'params trained through the tree vs the reference BERT: max '
           r'\|diff\| = ([\d.e+-]+)', out)
  assert float(m.group(1)) < 1e-5


def test_lora_sharded_small():
  """LoRA on every linear layer of a logically sharded Llama-style model on
  8 host devices: adapters named and sharded like their kernels, one step on
  the mesh equals one on a device, the loss goes down; then an abstract
  adapter plan (nothing materialised)."""
  pytest.importorskip('optax')
  out = run_example('lora_sharded.py', '--small')
  find(r"lora_a \('layers', 'embed', None\) \(2, 32, 4\), lora_b "
       r"\('layers', None, 'heads', 'kv'\) \(2, 4, 4, 8\)", out)
  find(r"q kernel PartitionSpec\(None, 'tp', 'fsdp', None\), its lora_a "
       r"PartitionSpec\(None, 'fsdp', None\)|q kernel P\(None, 'tp', 'fsdp', "
       r"None\), its lora_a P\(None, 'fsdp', None\)", out)
  m = find(r'max \|param diff\| ([\d.e+-]+)', out)
  assert float(m.group(1)) < 1e-5
  m = find(r'loss went down: ([\d.]+) -> ([\d.]+); frozen weights unchanged: '
           r'True', out)
  assert float(m.group(2)) < float(m.group(1))
  m = find(r'merged into the kernels, the model itself: max \|diff\| = '
           r'([\d.e+-]+)', out)
  assert float(m.group(1)) < 1e-4
  m = find(r'([\d.]+)B parameters \(abstract, nothing materialised\)', out)
  assert 1.0 < float(m.group(1)) < 1.2
  find(r"layers/q/lora_b +\(22, 16, 16, 128\) +\('layers', None, 'heads', "
       r"'kv'\)", out)


def test_memory_finetune_small(tmp_path):
  for module in ('optax', 'sklearn', 'matplotlib'):
    pytest.importorskip(module)
  png = tmp_path / 'curves.png'
  out = run_example('memory_finetune.py', '--small', '--out', str(png))
  find(r"fewbit: 3 sites, 3 bits each: \['gelu', 'gelu', 'gelu'\]", out)
  rows = {}
  for name in ('exact', 'fewbit 3-bit', 'randomized 20%',
               'fewbit \\+ randomized', 'lean norm \\+ GELU', 'all three',
               'plan 0.5'):
    m = find(rf'{name}\s+([\d.]+)\s+([\d.]+)Ki\s+([\d.]+)Ki\s+([\d.]+)', out)
    rows[name.replace('\\', '')] = [float(g) for g in m.groups()]
  exact, few = rows['exact'], rows['fewbit 3-bit']
  assert exact[0] > 0.9
  assert few[0] >= exact[0] - 0.01  # within 1 point of exact
  # Less kept for the backward pass, each rewrite alone and both.
  assert few[1] < exact[1] and rows['randomized 20%'][1] < exact[1]
  assert rows['fewbit + randomized'][1] < min(few[1],
                                              rows['randomized 20%'][1])
  find(r'fewbit 3-bit accuracy within 1 point of exact: True', out)
  # Lean norms and activations: exact gradients, less kept.
  lean, every = rows['lean norm + GELU'], rows['all three']
  assert lean[0] >= exact[0] - 0.01 and lean[1] < exact[1]
  assert every[1] < rows['fewbit + randomized'][1]
  find(r'lean norm \+ GELU accuracy within 1 point of exact: True', out)
  # The planner's tree meets its budget, measured again by the example's
  # own memory_report, and trains as well as the exact tree.
  plan = rows['plan 0.5']
  assert plan[3] <= 0.5 and plan[0] >= exact[0] - 0.01
  find(r'training memory [\d,]+ bytes = 0\.\d+ of the baseline', out)
  find(r'plan 0.5 accuracy within 1 point of exact: True', out)
  assert f'loss curves and memory per block saved to {png}' in out
  assert png.read_bytes().startswith(PNG_MAGIC)


def test_lora_keep_small():
  """LoRA fine-tuned on a tiny GPT-2, adapters saved and loaded in a fresh
  process, greedy generation with them unmerged at two batch sizes and two
  prompt lengths equal to the merged model's, ``yax.export`` of the merged
  tree served by a process that never imports YAX."""
  pytest.importorskip('optax')
  out = run_example('lora_keep.py', '--small')
  m = find(r'LoRA training: loss ([\d.]+) -> ([\d.]+)', out)
  assert float(m.group(2)) < float(m.group(1))
  for batch in (1, 3):
    for length in (3, 6):
      find(rf"batch {batch}, prompt {length}: unmerged adapters generate the "
           r"merged model's tokens \[[\d, ]+\]: True", out)
  for line in ('the adapters change the generation: True',
               'the export locates ops at their module paths: True',
               'yax was never imported here: True',
               "the served export computes the merged model's logits: True",
               'all checks passed: True'):
    assert line in out, out
