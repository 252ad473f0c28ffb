"""One record per failure, however many nodes see it.

When a rank fails, every node's agent sees its own workers fail: the node of the rank that died, and
each node whose ranks only saw their connection drop. Each agent deciding alone would count one fault
once per node and blame itself. So the agents agree through the rendezvous store of the round that
failed (torchrun's, shared by every agent; torch's c10d rendezvous gives each round a store of its own):

1. each agent posts its node's report (host, global ranks, their exit statuses) under the round's key;
   an agent whose workers are still running posts too, as soon as it sees that another node claimed
   the round, so a node that never posts is one that is gone;
2. the first agent to claim the round waits until every node posted (at most POST_WAIT_S), attributes
   the failure over all reports (keel.trainer.launch.restarts.attribute), decides by the budget, appends
   the record to RUN_DIR/control/failures.jsonl and publishes it in the store;
3. the others read the published record and follow its decision (restart, or give up).

So the budget, the `restart` event, the give-up and the console line happen once per failure. A single
node skips the store: its agent is the only one.

No torch here: the agent passes its store in (set, check, get and compare_set are all this uses).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict

from keel.trainer.launch.restarts import Failure, Node, RestartBudget

# How long the agent that claimed a failure waits for the other nodes' reports. A live agent posts
# within one monitor interval of the claim (torchrun's 0.1 s); one that has not after this is gone.
POST_WAIT_S = 10.0
# How long the others wait for the claimant's record before deciding alone (it died while deciding).
RECORD_WAIT_S = POST_WAIT_S + 30.0
_POLL_S = 0.1


class FailureBoard:
    """One node's side of the agreement, for one agent's life; `round_key` names the round (see agent.py).
    `joined` starts each round: the node's rank and the number of nodes may change from round to round."""

    def __init__(self, budget: RestartBudget, host: str):
        self.budget, self.host = budget, host
        self.node, self.nnodes = 0, 1
        self._posted: set[str] = set()  # the rounds this agent has posted a report in

    def joined(self, store, round_key: str, node: int, nnodes: int, ranks: list[int]) -> None:
        """At the start of a round: this node's host and ranks, so that a node lost later can be named."""
        self.node, self.nnodes = node, nnodes
        if nnodes > 1:
            store.set(f"{round_key}/node/{node}", json.dumps({"host": self.host, "ranks": ranks}))

    def failed(self, store, round_key: str, ranks: list[int], exits: dict[int, int], started: float) -> tuple[Failure, bool]:
        """The failure of this round as the job records it, and whether this node recorded it."""
        if self.nnodes == 1:
            return self.budget.record(exits, 0, started, {self.node: Node(self.host, ranks)}), True
        self._post(store, round_key, ranks, exits)
        claimant = store.compare_set(f"{round_key}/claim", "", str(self.node)).decode()
        if claimant == str(self.node):
            nodes, exits = self._wait_for_reports(store, round_key)
            failure = self.budget.record(exits, 0, started, nodes)
            store.set(f"{round_key}/record", json.dumps(asdict(failure)))
            return failure, True
        recorded = _wait_for(store, [f"{round_key}/record"], RECORD_WAIT_S)
        if not recorded:  # the claimant died before it recorded: this node decides alone
            return self.budget.record(exits, 0, started, {self.node: Node(self.host, ranks)}), True
        return Failure(**json.loads(store.get(f"{round_key}/record"))), False

    def still_running(self, store, round_key: str, ranks: list[int]) -> None:
        """Called while this node's workers are healthy: once another node claimed a failure of this round,
        posts that this node is alive (its workers will be stopped and restarted at the next round)."""
        if self.nnodes == 1 or round_key in self._posted or not store.check([f"{round_key}/claim"]):
            return
        self._post(store, round_key, ranks, {})

    def _post(self, store, round_key: str, ranks: list[int], exits: dict[int, int]) -> None:
        report = {"host": self.host, "ranks": ranks, "exits": {str(r): c for r, c in exits.items()}}
        store.set(f"{round_key}/report/{self.node}", json.dumps(report))
        self._posted.add(round_key)

    def _wait_for_reports(self, store, round_key: str) -> tuple[dict[int, Node], dict[int, int]]:
        """Every node of the round (those that posted no report within POST_WAIT_S: lost) and the exit
        statuses of all their ranks."""
        keys = [f"{round_key}/report/{n}" for n in range(self.nnodes)]
        _wait_for(store, keys, POST_WAIT_S)
        nodes, exits = {}, {}
        for n, key in enumerate(keys):
            if store.check([key]):
                report = json.loads(store.get(key))
                nodes[n] = Node(report["host"], report["ranks"])
                exits.update({int(r): c for r, c in report["exits"].items()})
            else:
                nodes[n] = self._joined_node(store, round_key, n)
        return nodes, exits

    def _joined_node(self, store, round_key: str, node: int) -> Node:
        """A node that reported nothing, as it joined the round."""
        key = f"{round_key}/node/{node}"
        joined = json.loads(store.get(key)) if store.check([key]) else {"host": f"node {node}", "ranks": []}
        return Node(joined["host"], joined["ranks"], reported=False)


def _wait_for(store, keys: list[str], seconds: float) -> bool:
    """Whether all `keys` appeared in the store within `seconds`."""
    deadline = time.monotonic() + seconds
    while not store.check(keys):
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)
    return True
