#!/usr/bin/env bash
# Installs EasyDeL 0.3.0 (an NNX model zoo: Llama, Mistral, Qwen 2, Gemma 2,
# Mixtral, ...) that tests/real/test_easydel.py runs, into the environment of the
# given Python, keeping jax, jaxlib, flax and everything else that is
# already installed at its version, except transformers (and its
# huggingface-hub), which EasyDeL needs at 5.x:
#
#   bash tests/install_easydel.sh [PYTHON]     # default: python
#
# Run it after `pip install -e ".[test]"` in an environment of its own: the
# rest of the test suite needs transformers<5 (its Flax models are gone from
# transformers 5), EasyDeL needs transformers 5.5. CI does this in
# .ci-venv-easydel (see .ci/run); by hand:
#
#   python3 -m venv .venv-easydel && .venv-easydel/bin/pip install -e ".[test]"
#   bash tests/install_easydel.sh .venv-easydel/bin/python
#   .venv-easydel/bin/python -m pytest -q tests/real/test_easydel.py
#
# Takes about 20 s with a warm pip cache and adds about 330 MB (ray is two
# thirds of it); never PyTorch. Exits non-zero if an install fails, if any
# package that was installed before changed its version (transformers and
# huggingface-hub excepted, by design), or if torch got installed.
#
# Why not plain `pip install easydel==0.3.0`: its pins (flax==0.12.3,
# ejkernel's jax~=0.9.0, ray[default], grain, datasets, wandb, gcsfs,
# uvloop==0.21.0, msgspec~=0.19, ...) do not resolve with jax 0.10.2 / flax
# 0.12.8 and would replace the JAX under test. The model code runs with what
# is installed here: easydel, eformer and ejkernel go in with --no-deps, then
# what their import actually needs (jaxtyping and einops are imported by
# ejkernel's kernels but are not in the recipe of shared/NOTES.md, which had
# them from the real-model install). Already installed by ".[test]" and kept
# at their versions by the constraints: optax, pyyaml, tqdm, psutil,
# tensorstore, jinja2, pillow, safetensors, tokenizers.
# The import itself needs workarounds (EASYDEL_AUTO=0, five Hugging Face
# modeling modules that need torch): see tests/real/test_easydel.py.
# pip would report the requirements left out above as "dependency conflicts"
# (expected, by design): --no-warn-conflicts silences that report; the
# check at the end is what guards the existing environment.
set -euo pipefail

PY="${1:-python}"
command -v "$PY" >/dev/null 2>&1 || { echo "install_easydel.sh: $PY not found" >&2; exit 1; }

# EasyDeL and its two sibling libraries, without their (unresolvable)
# requirements.
NO_DEPS=(
  "easydel==0.3.0"
  "eformer==0.0.99.12"
  "ejkernel==0.0.78"
)
# What they import, installed with their own requirements, which must be
# satisfied by what is already installed (see the constraints below) except
# for the packages in MAY_CHANGE.
WITH_DEPS=(
  "transformers==5.5.4"
  "huggingface-hub==1.33.0"
  "ray==2.54.0"
  "google-cloud-storage==3.17.1"
  "ml-collections==1.1.0"
  "plum-dispatch==2.3.2"
  "mergedeep==1.3.4"
  "tblib==3.0.0"
  "contextlib2==21.6.0"
  "braceexpand==0.1.7"
  "chex==0.1.92"
  "beartype==0.23.1"
  "pydantic==2.14.4"
  "msgspec==0.22.0"
  "pyzmq==27.3.0"
  "partial-json-parser==0.2.1.1.post7"
  "fastapi==0.165.0"
  "uvicorn==0.54.0"
  "jaxtyping==0.3.11"
  "einops==0.8.2"
)
# Installed before (transformers<5 from ".[test]") and replaced on purpose.
MAY_CHANGE=(transformers huggingface-hub)

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# Every package installed now, except MAY_CHANGE, is pinned to its current
# version: pip fails rather than upgrade or downgrade any of them.
"$PY" -m pip freeze --exclude-editable 2>/dev/null | grep -v ' @ ' \
  | grep -vE '^(pip|setuptools|wheel)==' > "$work/before.txt" || true
"$PY" - "$work/before.txt" "$work/constraints.txt" "${MAY_CHANGE[@]}" <<'EOF'
import re, sys
norm = lambda n: re.sub(r'[-_.]+', '-', n).lower()
src, dst, may_change = sys.argv[1], sys.argv[2], {norm(n) for n in sys.argv[3:]}
with open(src) as f, open(dst, 'w') as out:
  for line in f:
    if '==' in line and norm(line.split('==', 1)[0]) not in may_change:
      out.write(line)
EOF

start=$SECONDS
"$PY" -m pip install -q --disable-pip-version-check --no-warn-conflicts --no-deps "${NO_DEPS[@]}"
"$PY" -m pip install -q --disable-pip-version-check --no-warn-conflicts -c "$work/constraints.txt" \
  "${WITH_DEPS[@]}"
echo "install_easydel.sh: installed in $((SECONDS - start)) s:" \
     "${NO_DEPS[*]} (--no-deps) ${WITH_DEPS[*]}"

# Check that nothing that was installed before changed (MAY_CHANGE aside),
# jax/jaxlib/flax above all, and that no PyTorch came in.
"$PY" - "$work/before.txt" "${MAY_CHANGE[@]}" <<'EOF'
import re, sys
from importlib.metadata import version, PackageNotFoundError
norm = lambda n: re.sub(r'[-_.]+', '-', n).lower()
may_change = {norm(n) for n in sys.argv[2:]}
def have(name):
  try:
    return version(name)
  except PackageNotFoundError:
    return None
changed, replaced = [], []
for line in open(sys.argv[1]):
  line = line.strip()
  if '==' not in line:
    continue
  name, want = line.split('==', 1)
  got = have(name)
  if got != want:
    (replaced if norm(name) in may_change else changed).append(
        f'{name}: {want} -> {got}')
for name in ('jax', 'jaxlib', 'flax'):
  if have(name) is None:
    changed.append(f'{name}: not installed (run pip install -e ".[test]" first)')
if have('torch') is not None:
  changed.append(f'torch {have("torch")} was installed (EasyDeL runs without it)')
if changed:
  sys.exit('install_easydel.sh: the install changed packages that were '
           'installed before:\n  ' + '\n  '.join(changed))
kept = ', '.join(f'{n} {have(n)}' for n in ('jax', 'jaxlib', 'flax', 'numpy')
                 if have(n))
print(f'install_easydel.sh: no previously installed package changed ({kept});'
      f' replaced on purpose: {", ".join(replaced) or "none"}')
EOF
