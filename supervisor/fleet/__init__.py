"""agentd on many machines: Ray places runs, one agentd daemon per node owns them.

``agentd fleet up`` starts a node agent (a detached Ray actor pinned to its node) and
through it one daemon per node; ``agentd fleet serve`` runs the front, which speaks the
control protocol of a single daemon and routes each run to its node. Ray is an optional
extra (``agentd[fleet]``): importing this package does not import it; the modules that
need it (``_agent``, ``_front``, ``_serve``) do.
"""

from supervisor.fleet._resources import BROWSER as BROWSER
from supervisor.fleet._resources import SLOTS as SLOTS
from supervisor.fleet._resources import node_resources as node_resources
from supervisor.fleet._resources import split_demand as split_demand
from supervisor.fleet.cli import fleet_state_dir as fleet_state_dir

__all__ = ["BROWSER", "SLOTS", "node_resources", "split_demand", "fleet_state_dir"]
