"""Map a SLURM allocation onto the `launch:` fields (no torch, no I/O beyond the env).

Under ``srun`` every node runs one ``litegen launch`` and each launcher starts the local
ranks, so SLURM only has to tell torchrun how many nodes there are, which one this is,
where the rendezvous lives and which job the nodes belong to.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", ""}

# `node[01-04,07]` -> prefix `node`, first range item `01`; anything fancier (several
# bracket groups, nested lists) is left to MASTER_ADDR.
_BRACKET = re.compile(r"^(?P<prefix>[^\[\],]+)\[(?P<first>[0-9]+)(?:-[0-9]+)?(?:,[^\]]*)?\]")


def first_host(nodelist: str) -> str | None:
    """Return the first host of a SLURM node list, or None when the pattern is too complex.

    >>> first_host("gpu-a,gpu-b")
    'gpu-a'
    >>> first_host("node[03-05]")
    'node03'
    """
    nodelist = nodelist.strip()
    if not nodelist:
        return None
    head = nodelist.split("[", 1)[0]
    if "," in head or "[" not in nodelist:
        # The first entry is a plain host name: `a,b[1-2]` or `a,b`.
        return head.split(",")[0].strip() or None
    match = _BRACKET.match(nodelist)
    if match is None:
        return None
    return f"{match['prefix']}{match['first']}"


def split_endpoint(endpoint: str) -> tuple[str, str]:
    """Split ``host:port`` into its parts (IPv6 hosts keep their brackets).

    >>> split_endpoint("node01:29500")
    ('node01', '29500')
    """
    host, sep, port = endpoint.rpartition(":")
    if not sep:
        return endpoint, "29500"
    return host, port


def apply_slurm_env(launch: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """Fill the `launch:` fields the recipe left unset from a SLURM job's environment.

    Fields written in the recipe (or given as overrides) always win. The rendezvous host
    comes from MASTER_ADDR, else the first node of SLURM_JOB_NODELIST; the port stays the
    one of ``rdzv_endpoint``. Outside SLURM (no SLURM_JOB_ID) the dict is returned as is.

    >>> apply_slurm_env({"entry": "m"}, {"SLURM_JOB_ID": "7", "SLURM_NNODES": "2",
    ...     "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "n[1-2]"})["rdzv_endpoint"]
    'n1:29500'
    """
    if not env.get("SLURM_JOB_ID"):
        return launch
    out = dict(launch)
    nnodes = env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES")
    if "nnodes" not in out and nnodes:
        out["nnodes"] = nnodes
    if "node_rank" not in out and env.get("SLURM_NODEID"):
        out["node_rank"] = env["SLURM_NODEID"]
    if "rdzv_id" not in out:
        out["rdzv_id"] = env["SLURM_JOB_ID"]

    endpoint = out.get("rdzv_endpoint")
    host, port = split_endpoint(str(endpoint)) if endpoint else ("", "29500")
    # An explicit non-local host is the recipe "saying otherwise"; a localhost one cannot
    # be right on a multi-node allocation, so only its port is kept.
    if host in LOCAL_HOSTS:
        slurm_host = env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST", ""))
        if slurm_host:
            out["rdzv_endpoint"] = f"{slurm_host}:{port}"
    return out
