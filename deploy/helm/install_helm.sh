#!/usr/bin/env bash
# Installs what tests/deploy/test_helm.py renders and validates the chart with, into a virtual environment (default: the
# repository's .venv), when missing:
#   helm-python-sdk      Helm 4's Go SDK (chart loading, rendering, `helm lint`, values.schema.json) behind a
#                        Python API, as a prebuilt wheel from PyPI: no helm binary, no Go toolchain
#   kubernetes-validate  the Kubernetes JSON schemas (1.25-1.37) and a validator
# Idempotent and quiet when both are there. Usage: bash deploy/helm/install_helm.sh [VENV]
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${1:-.venv}"
HELM_SDK="helm-python-sdk==0.2.2"
K8S_VALIDATE="kubernetes-validate==1.37.0"

[ -x "$VENV/bin/python" ] || { echo "install_helm.sh: no virtual environment at $VENV" >&2; exit 1; }
if "$VENV/bin/python" -c 'import helm_python, kubernetes_validate' 2>/dev/null; then
    echo "helm-python-sdk and kubernetes-validate already installed"
    exit 0
fi
"$VENV/bin/pip" install -q --disable-pip-version-check "$HELM_SDK" "$K8S_VALIDATE" 2>&1 | grep -v '^WARNING: Location' || true
"$VENV/bin/python" -c 'import helm_python as h, kubernetes_validate.utils as k
print("helm SDK", h.helm_sdk_version(), "(helm-python-sdk", h.__version__ + "); kubernetes-validate schemas up to", k.latest_version())'
