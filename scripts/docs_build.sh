#!/usr/bin/env bash
# Build the documentation site as CI does: mkdocs build --strict (a broken link or anchor, a
# page left out of the nav, a repository path or jaxserve.* name a page cites that does not
# exist, or a configuration table docs/gen_config.py cannot make fails it), into a temporary
# directory that is removed afterwards. Needs the docs extra: pip install -e '.[docs]'.
# Usage: bash scripts/docs_build.sh [SITE_DIR]   (SITE_DIR: keep the site there instead)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -ge 1 ]; then
  site="$1"
else
  site="$(mktemp -d "${TMPDIR:-/tmp}/jaxserve-docs.XXXXXX")"
  trap 'rm -rf "$site"' EXIT
fi
python3 -m mkdocs build --strict -f mkdocs.yml -d "$site"
echo "docs_build.sh: built $site"
