"""Who is which rank: the environment torchrun would give each process, from where the actors landed.

Ranks are numbered node by node (the placement group's bundle order), so
rank 0 is the first actor of the first node, and MASTER_ADDR is its node.
On GPUs Ray shows each actor only its own device; the ranks of one node are
instead shown all the node's devices they hold, and LOCAL_RANK picks theirs
(as torchrun's ranks see the node's GPUs), so NCCL can use intra-node links.
"""

from __future__ import annotations


def rank_envs(places: list[dict], master_port: int) -> list[dict[str, str]]:
    """One environment per actor; `places`: each actor's {"node": id, "ip": address, "gpus": [ids]}, rank order."""
    by_node: dict[str, list[int]] = {}
    for i, place in enumerate(places):
        by_node.setdefault(place["node"], []).append(i)
    envs = []
    for i, place in enumerate(places):
        mates = by_node[place["node"]]
        env = {"MASTER_ADDR": places[0]["ip"], "MASTER_PORT": str(master_port), "RANK": str(i),
               "WORLD_SIZE": str(len(places)), "LOCAL_RANK": str(mates.index(i)),
               "LOCAL_WORLD_SIZE": str(len(mates)), "GROUP_RANK": str(list(by_node).index(place["node"]))}
        if place["gpus"]:
            devices = [g for mate in mates for g in places[mate]["gpus"]]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
            env["LOCAL_RANK"] = str(devices.index(place["gpus"][0]))
        envs.append(env)
    return envs
