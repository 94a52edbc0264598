"""Turns one version of a CustomResourceDefinition's openAPIV3Schema into a JSON Schema file here.

    python tests/schemas/crd_to_jsonschema.py CRD.yaml VERSION "repo file@tag (commit)" > tests/schemas/KIND.json

What changes (README.md beside this file says why):
- descriptions and the ``x-kubernetes-*`` keys go (CEL rules cannot be checked by a JSON Schema
  validator; list and map types say how the API server merges, not what is valid);
- ``nullable: true`` becomes a ``null`` type, ``x-kubernetes-int-or-string`` an integer-or-string;
- every object that lists its properties and neither says what else it takes nor preserves unknown
  fields gets ``additionalProperties: false``: the API server prunes (or, with strict field
  validation, refuses) any other field, so a misspelled one fails here instead;
- the top level pins ``apiVersion`` and ``kind`` and requires them and ``metadata``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

DROPPED = {"description"}
DRAFT = "https://json-schema.org/draft/2020-12/schema"


def convert(node: Any) -> Any:
    if isinstance(node, list):
        return [convert(item) for item in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in DROPPED or key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key == "properties":
            out[key] = {name: convert(sub) for name, sub in value.items()}
        elif key in ("default", "enum", "example"):
            out[key] = value  # values, not schemas
        else:
            out[key] = convert(value)
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    if ("properties" in out and "additionalProperties" not in out
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def crd_schema(crd: dict[str, Any], version: str, source: str) -> dict[str, Any]:
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema: dict[str, Any] = convert(served["schema"]["openAPIV3Schema"])
    schema["properties"]["apiVersion"] = {"const": f"{group}/{version}"}
    schema["properties"]["kind"] = {"const": kind}
    schema["required"] = sorted({"apiVersion", "kind", "metadata", *schema.get("required", [])})
    return {"$schema": DRAFT, "$comment": f"{kind} {group}/{version}, converted from the CRD in {source} "
            "by tests/schemas/crd_to_jsonschema.py", **schema}


def main(argv: list[str]) -> int:
    path, version, source = argv
    crd = yaml.safe_load(Path(path).read_text())
    json.dump(crd_schema(crd, version, source), sys.stdout, separators=(",", ":"), sort_keys=True)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
