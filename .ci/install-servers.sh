#!/usr/bin/env bash
# Install what the local protocol servers in tests/support/servers.py need.
#
#   bash .ci/install-servers.sh VENV_DIR
#
# Idempotent: safe to run on every CI start. Installs
#   - into VENV_DIR (uv where the venv has it, else pip): moto[s3] flask flask-cors gcp-storage-emulator aiohttp s3fs gcsfs adlfs
#   - into .ci/azurite (npm, git-ignored): azurite@3.35.0 (3.36+ needs a newer Node than 20)
# Uses apt only when node/npm are missing. Talks to package registries only.
set -euo pipefail

VENV="${1:?usage: $0 VENV_DIR}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$VENV/bin/python"
AZURITE_VERSION="3.35.0"
AZURITE_DIR="$ROOT/.ci/azurite"

if [[ ! -x "$PY" ]]; then
    echo "install-servers: no python at $PY" >&2
    exit 2
fi

# --- Python packages (already satisfied ones are skipped; no upgrades) ------------
SERVERS=("moto[s3]>=5" flask flask-cors gcp-storage-emulator aiohttp s3fs gcsfs adlfs)
if [[ -x "$VENV/bin/uv" ]]; then
    "$VENV/bin/uv" pip install --quiet --python "$PY" "${SERVERS[@]}"
else
    "$PY" -m pip install --quiet --disable-pip-version-check "${SERVERS[@]}"
fi

"$PY" - <<'EOF'
import importlib.util, sys
mods = ["moto.server", "flask", "flask_cors", "gcp_storage_emulator", "aiohttp",
        "s3fs", "gcsfs", "adlfs", "azure.storage.blob"]
missing = [m for m in mods if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"install-servers: still missing python modules: {missing}")
EOF

# --- Node + azurite -------------------------------------------------------------
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    echo "install-servers: node/npm missing; installing from Debian" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq nodejs npm
fi

installed_version() {
    local pkg="$AZURITE_DIR/node_modules/azurite/package.json"
    [[ -f "$pkg" ]] || return 0
    node -e 'process.stdout.write(require(process.argv[1]).version)' "$pkg" 2>/dev/null || true
}

if [[ "$(installed_version)" != "$AZURITE_VERSION" \
      || ! -x "$AZURITE_DIR/node_modules/.bin/azurite-blob" ]]; then
    mkdir -p "$AZURITE_DIR"
    npm install --prefix "$AZURITE_DIR" --no-audit --no-fund --save-exact \
        --loglevel=error "azurite@$AZURITE_VERSION"
fi

if [[ "$(installed_version)" != "$AZURITE_VERSION" ]]; then
    echo "install-servers: azurite $AZURITE_VERSION did not install in $AZURITE_DIR" >&2
    exit 1
fi

echo "install-servers: ok (python: $("$PY" -c 'import moto, gcsfs, s3fs, adlfs; print("moto", moto.__version__, "s3fs", s3fs.__version__, "gcsfs", gcsfs.__version__, "adlfs", adlfs.__version__)'); node $(node --version); azurite $AZURITE_VERSION)"
