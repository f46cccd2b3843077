#!/usr/bin/env bash
# Installs the real third-party model code that tests/test_real_models.py
# (Linen: Google DeepMind `gemma`, `recurrentgemma`) and
# tests/test_real_nnx.py (NNX: Google `tunix` Llama 3, Qwen 3, Gemma 3) run,
# into the environment of the given Python, WITHOUT changing anything that is
# already installed there (jax, jaxlib, flax, transformers<5, numpy, ...):
#
#   bash tests/install_real_models.sh [PYTHON]     # default: python
#
# Run it after `pip install -e ".[test]"`. Takes about 10-15 s and adds about
# 25 MB here (no TensorFlow, no PyTorch). Exits non-zero if an install fails
# or if any package that was installed before changed its version.
#
# Why not plain `pip install gemma recurrentgemma google-tunix`:
# * gemma 3.3.0 needs kauldron, whose requirements (tensorflow,
#   tensorflow_datasets, xmanager, grain, opencv, ...) never finish resolving
#   and would bring TensorFlow. The model code (`gemma.gm.nn`) needs only
#   a few of them: installed with --no-deps plus those few (einops, jaxtyping,
#   typeguard>=4, clu, lark, immutabledict, sentencepiece, chex).
#   kauldron.typing imports tensorflow for `tf.Tensor` alone; the test puts a
#   stub module there while it imports gemma (see test_real_models.py).
# * recurrentgemma 1.0.1 pins numpy<2.4, absl-py<2 and typeguard<3; its JAX
#   code runs with the numpy/absl already installed (--no-deps). kauldron
#   needs typeguard>=4.4.1, which is what is installed: the test disables
#   recurrentgemma's import-time typeguard instrumentation (its runtime shape
#   checks), which typeguard 4 cannot parse (see test_real_models.py).
# * google-tunix 0.1.7 requires its whole trainer stack (datasets, grain,
#   tensorflow_datasets, vLLM mappings, safetensors<0.8 ...). The model modules
#   (`tunix.models.<family>.model`) import only jax, flax, jaxtyping and
#   einops; the test imports them with the package __init__ stubbed
#   (see test_real_nnx.py).
# pip would report the requirements left out above as "dependency conflicts"
# (expected, by design): --no-warn-conflicts silences that report; the
# check at the end is what guards the existing environment.
set -euo pipefail

PY="${1:-python}"
command -v "$PY" >/dev/null 2>&1 || { echo "install_real_models.sh: $PY not found" >&2; exit 1; }

# Real model code, installed without its (unresolvable or conflicting)
# requirements.
NO_DEPS=(
  "gemma==3.3.0"
  "kauldron==1.4.2"
  "recurrentgemma==1.0.1"
  "google-tunix==0.1.7"
)
# What that model code imports, installed with its own requirements, which
# must be satisfied by what is already installed (see the constraints below).
WITH_DEPS=(
  "einops==0.8.2"
  "jaxtyping==0.3.11"
  "typeguard==4.6.1"
  "clu==0.0.12"
  "lark==1.3.1"
  "immutabledict==4.3.1"
  "sentencepiece==0.2.3"
  "chex==0.1.92"
)

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# Every package installed now is pinned to its current version: pip fails
# rather than upgrade or downgrade any of them.
"$PY" -m pip freeze --exclude-editable 2>/dev/null | grep -v ' @ ' \
  | grep -vE '^(pip|setuptools|wheel)==' > "$work/before.txt" || true
cp "$work/before.txt" "$work/constraints.txt"

start=$SECONDS
"$PY" -m pip install -q --disable-pip-version-check --no-warn-conflicts --no-deps "${NO_DEPS[@]}"
"$PY" -m pip install -q --disable-pip-version-check --no-warn-conflicts -c "$work/constraints.txt" \
  "${WITH_DEPS[@]}"
echo "install_real_models.sh: installed in $((SECONDS - start)) s:" \
     "${NO_DEPS[*]} (--no-deps) ${WITH_DEPS[*]}"

# Check that nothing that was installed before changed.
"$PY" - "$work/before.txt" <<'EOF'
import sys
from importlib.metadata import version, PackageNotFoundError
changed = []
for line in open(sys.argv[1]):
  line = line.strip()
  if '==' not in line:
    continue
  name, want = line.split('==', 1)
  try:
    got = version(name)
  except PackageNotFoundError:
    got = None
  if got != want:
    changed.append(f'{name}: {want} -> {got}')
if changed:
  sys.exit('install_real_models.sh: the install changed packages that were '
           'installed before:\n  ' + '\n  '.join(changed))
def have(name):
  try:
    return version(name)
  except PackageNotFoundError:
    return None
kept = ', '.join(f'{n} {have(n)}' for n in
                 ('jax', 'jaxlib', 'flax', 'numpy', 'transformers') if have(n))
print(f'install_real_models.sh: no previously installed package changed ({kept})')
EOF
