#!/usr/bin/env bash
# Installs the real third-party model code that the test suite runs into the
# environment of the given Python, WITHOUT changing anything that is already
# installed there (jax, jaxlib, flax, transformers<5, numpy, ...):
#
#   bash tests/install_real_models.sh [PYTHON]     # default: python
#
# Run it after `pip install -e ".[test]"`. What it installs depends on the
# Python version (one set of third-party model code per Python version):
#
# * Python 3.11: Google DeepMind `gemma` 3.3.0 (kauldron 1.4.2) and
#   `recurrentgemma` (Linen: tests/real/test_real_models.py), Google `tunix` Llama
#   3, Qwen 3, Gemma 3 (NNX: tests/real/test_real_nnx.py). About 10-15 s, 25 MB.
# * Python >= 3.12 (where the newest JAX installs): `gemma` 4.0.1 (kauldron
#   1.4.4; it needs Python >= 3.12 and adds Gemma 4: tests/real/test_gemma4.py;
#   its Gemma 3 Transformer is what tests/real/test_real_models.py builds),
#   recurrentgemma and tunix as above, and MaxText 0.2.5 (NNX decoders and
#   their Linen bridge: tests/real/test_maxtext.py; it needs Python >= 3.12 too).
#   About 1.5 min with a cold pip cache, 300 MB (no TensorFlow, no PyTorch).
#
# Exits non-zero if an install fails or if any package that was installed
# before changed its version.
#
# Why not plain `pip install gemma recurrentgemma google-tunix maxtext`:
# * gemma needs kauldron, whose requirements (tensorflow,
#   tensorflow_datasets, xmanager, grain, opencv, ...) never finish resolving
#   and would bring TensorFlow. The model code (`gemma.gm.nn`) needs only
#   a few of them: installed with --no-deps plus those few (einops, jaxtyping,
#   typeguard>=4, clu, lark, immutabledict, sentencepiece, chex; gemma 4
#   also ml_collections and dialog).
#   kauldron.typing imports tensorflow for `tf.Tensor` alone; the tests put a
#   stub module there while they import gemma (tests/helpers.py).
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
# * maxtext 0.2.5's requirements want jax>=0.11.1 with libtpu or CUDA and
#   google-cloud: installed with --no-deps (and tokamax, xprof, which it
#   imports), then what `maxtext.models.models` and its config loader import
#   (pydantic, omegaconf, qwix, aqtp, grain, ...).
# pip would report the requirements left out above as "dependency conflicts"
# (expected, by design): --no-warn-conflicts silences that report; the
# check at the end is what guards the existing environment.
set -euo pipefail

PY="${1:-python}"
command -v "$PY" >/dev/null 2>&1 || { echo "install_real_models.sh: $PY not found" >&2; exit 1; }

PY_MINOR="$("$PY" -c 'import sys; print(sys.version_info[1] if sys.version_info[0] == 3 else 0)')"

# NO_DEPS: real model code, installed without its (unresolvable or
# conflicting) requirements. WITH_DEPS: what that model code imports,
# installed with its own requirements, which must be satisfied by what is
# already installed (see the constraints below); first what gemma,
# recurrentgemma and tunix import on every Python version.
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
if [ "$PY_MINOR" -ge 12 ]; then
  NO_DEPS=(
    "gemma==4.0.1"
    "kauldron==1.4.4"
    "recurrentgemma==1.0.1"
    "google-tunix==0.1.7"
    "maxtext==0.2.5"
    "tokamax==0.0.15"
    "xprof==2.24.2"
    # Equinox model code (tests/real/test_equinox.py; eqx-zoo needs
    # Python >= 3.12, equimo 2.7.0 jax >= 0.11.1)
    "eqx-zoo==0.3.5"
    "esm2quinox==0.2.0"
    "equimo==2.7.0"
  )
  WITH_DEPS+=(
    # gemma 4
    "ml-collections==1.1.0"
    "dialog==1.1.0"
    # MaxText
    "pydantic==2.14.4"
    "omegaconf==2.4.0"
    "pathwaysutils==0.1.13"
    "qwix==0.1.8"
    "aqtp==0.9.0"
    "einshape==1.0"
    "fire==0.7.1"
    "six==1.17.0"
    "grain==0.2.18"
    "drjax==0.2.1"
    "tiktoken==0.14.0"
    "sympy==1.14.0"
    # what eqx-zoo, esm2quinox and equimo import
    "equinox==0.13.8"
    "safetensors"
    "huggingface-hub"
    "banax==0.1.5"
    "loguru==0.7.3"
    "lz4==4.4.5"
    "requests"
  )
else
  NO_DEPS=(
    "gemma==3.3.0"
    "kauldron==1.4.2"
    "recurrentgemma==1.0.1"
    "google-tunix==0.1.7"
  )
fi

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
