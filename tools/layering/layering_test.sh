#!/usr/bin/env bash
# Runs check_layers.py on the genquery's XML: fails on a dependency that
# runs upward. First the checker is shown to catch one (a copy of the query
# with an edge from //rpc/core to //ddp added), so that a checker that
# passes everything fails here.
set -euo pipefail
checker=$1
xml=$2
python3 "$checker" "$xml"
bad=$(mktemp)
trap 'rm -f "$bad"' EXIT
python3 - "$xml" "$bad" <<'PY'
import sys
import xml.etree.ElementTree as ET
tree = ET.parse(sys.argv[1])
for rule in tree.getroot().findall("rule"):
    if rule.get("name", "").startswith("//rpc/core:"):
        deps = next((l for l in rule.findall("list") if l.get("name") == "deps"), None)
        if deps is None:
            deps = ET.SubElement(rule, "list", name="deps")
        ET.SubElement(deps, "label", value="//ddp:ddp")
        break
else:
    sys.exit("no //rpc/core rule in the query")
tree.write(sys.argv[2])
PY
if python3 "$checker" "$bad" >/dev/null; then
  echo "check_layers.py passed a query with //rpc/core depending on //ddp"
  exit 1
fi
echo "an upward edge is caught"
