#!/usr/bin/env python3
"""Pin a Kubernetes overlay's images by digest: write a new overlay that builds on it and names
every image by `@sha256:...`, so what runs is exactly what was pushed (a tag can be moved; a
digest cannot).

    python3 deploy/k8s/pin_images.py deploy/k8s/overlays/gpu --out my-overlays/gpu-pinned \\
        --image dapo-services=registry.example.com/dapo-services

For each image the overlay runs (`kubectl kustomize OVERLAY`), the digest of the pushed image is
asked of the registry with the first resolver found: `crane digest`, `skopeo inspect`, or
`docker buildx imagetools inspect` (`DIGEST_COMMAND` names another: it gets the reference as its
one argument and prints the digest). `--image NAME=REPO` says where NAME was pushed (default: the
name itself, e.g. `redis`), `--tag IMAGE=TAG` under which tag. The new overlay's kustomization
lists the old overlay as its only resource and patches each container's image to
`REPO@sha256:...`; apply that one. Nothing else changes. `--check OVERLAY` fails (exit 1) when any
container of an overlay runs an image without a digest.

Images here run by tag as built: `deploy/local-docker.sh build` tags them locally and no
registry is reachable from where this was written, so the repository's overlays are not pinned;
pin yours after pushing.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
RESOLVE_TIMEOUT_S = 120
"""How long one resolver may take to answer for one image (a registry that hangs is an error)."""
WORKLOADS = {"Deployment", "StatefulSet", "Job", "DaemonSet"}


def containers(overlay: Path) -> list[tuple[str, str, str, str]]:
    """(kind, name, JSON path of the image, image) of every container and init container of the
    workloads `overlay` renders (`kubectl kustomize`)."""
    out = subprocess.run(
        ["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, check=True
    ).stdout
    found = []
    for doc in yaml.safe_load_all(out):
        if not doc or doc.get("kind") not in WORKLOADS:
            continue
        pod = doc["spec"]["template"]["spec"]
        for key in ("containers", "initContainers"):
            for i, c in enumerate(pod.get(key) or []):
                path = f"/spec/template/spec/{key}/{i}/image"
                found.append((doc["kind"], doc["metadata"]["name"], path, str(c["image"])))
    return found


def split_image(image: str) -> tuple[str, str]:
    """`repo:tag` -> (repo, tag); a digest reference keeps its digest as the tag."""
    if "@" in image:
        repo, digest = image.split("@", 1)
        return repo, digest
    repo, sep, tag = image.rpartition(":")
    if not sep or "/" in tag:  # no tag (a port in the registry host is not one)
        return image, "latest"
    return repo, tag


def resolve(reference: str) -> str:
    """The digest of `reference` in its registry."""
    custom = os.environ.get("DIGEST_COMMAND")
    if custom:
        commands = [[*custom.split(), reference]]
    else:
        commands = []
        if shutil.which("crane"):
            commands.append(["crane", "digest", reference])
        if shutil.which("skopeo"):
            commands.append(
                ["skopeo", "inspect", "--format", "{{.Digest}}", f"docker://{reference}"]
            )
        if shutil.which("docker"):
            commands.append(
                [
                    "docker",
                    "buildx",
                    "imagetools",
                    "inspect",
                    reference,
                    "--format",
                    "{{json .Manifest.Digest}}",
                ]
            )
    if not commands:
        sys.exit("pin_images: no resolver (crane, skopeo or docker buildx) and no DIGEST_COMMAND")
    errors = []
    for command in commands:
        try:
            proc = subprocess.run(
                command, capture_output=True, text=True, check=False, timeout=RESOLVE_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            errors.append(f"{' '.join(command)}: no answer in {RESOLVE_TIMEOUT_S} s")
            continue
        found = DIGEST.search(proc.stdout)
        if proc.returncode == 0 and found:
            return found.group(0)
        errors.append(f"{' '.join(command)}: {proc.stderr.strip() or proc.stdout.strip()}")
    sys.exit(f"pin_images: no digest for {reference}:\n  " + "\n  ".join(errors))


def pinned(image: str) -> bool:
    return "@" in image and bool(DIGEST.fullmatch(image.rsplit("@", 1)[1]))


def unpinned(overlay: Path) -> list[str]:
    return sorted({image for *_, image in containers(overlay) if not pinned(image)})


def pin(overlay: Path, out: Path, pushed: dict[str, str], tags: dict[str, str]) -> list[str]:
    """Write out/kustomization.yaml: `overlay` with every container's image replaced by its
    digest (one JSON patch per workload: an `images:` entry matches by name only, and the GPU
    overlay runs two tags of one name). Returns what was pinned, one line per image."""
    digests: dict[str, str] = {}
    lines = []
    patches: dict[tuple[str, str], list[dict[str, str]]] = {}
    for kind, name, path, image in containers(overlay):
        if pinned(image):
            continue
        if image not in digests:
            repo, tag = split_image(image)
            repo = pushed.get(repo, repo)
            digests[image] = f"{repo}@{resolve(f'{repo}:{tags.get(image, tag)}')}"
            lines.append(f"{image} -> {digests[image]}")
        patches.setdefault((kind, name), []).append(
            {"op": "replace", "path": path, "value": digests[image]}
        )
    out.mkdir(parents=True, exist_ok=True)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(overlay.resolve(), out.resolve())],
        "patches": [
            {"target": {"kind": kind, "name": name}, "patch": yaml.safe_dump(ops, sort_keys=False)}
            for (kind, name), ops in sorted(patches.items())
        ],
    }
    header = f"# Generated by deploy/k8s/pin_images.py from {overlay}: every image by digest.\n"
    (out / "kustomization.yaml").write_text(header + yaml.safe_dump(kustomization, sort_keys=False))
    return lines


def pairs(parser: argparse.ArgumentParser, flag: str, items: list[str]) -> dict[str, str]:
    """`--flag KEY=VALUE` arguments as a dict; one without `=` or with an empty side is a usage
    error naming it."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not (sep and key and value):
            parser.error(f"{flag} {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overlay", type=Path, help="the overlay to pin (or to check)")
    parser.add_argument("--out", type=Path, help="where to write the pinned overlay")
    parser.add_argument(
        "--image", action="append", default=[], metavar="NAME=REPO", help="where NAME was pushed"
    )
    parser.add_argument(
        "--tag",
        action="append",
        default=[],
        metavar="IMAGE=TAG",
        help="the pushed tag of a rendered image (default: its own tag)",
    )
    parser.add_argument("--check", action="store_true", help="fail if any image has no digest")
    args = parser.parse_args(argv)
    if args.check:
        missing = unpinned(args.overlay)
        for image in missing:
            sys.stdout.write(f"not pinned by digest: {image}\n")
        return 1 if missing else 0
    if args.out is None:
        parser.error("--out is required (the pinned overlay's directory)")
    pushed, tags = pairs(parser, "--image", args.image), pairs(parser, "--tag", args.tag)
    for line in pin(args.overlay, args.out, pushed, tags):
        sys.stdout.write(f"{line}\n")
    sys.stdout.write(f"wrote {args.out / 'kustomization.yaml'}: kubectl apply -k {args.out}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
