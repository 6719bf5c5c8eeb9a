"""Runner trees: a runner and everything it starts, as processes the daemon owns.

``process`` (spawn a tree, stop it: path A and path B, find it again after a restart),
``containment`` (where trees live: a cgroup each, the subreaper, adopted zombies,
strays), ``_cgroupfs`` (whose cgroup subtree is whose), ``_handles`` (``Tree``,
``AdoptedTree``, stop receipts), ``zygote`` (runners forked from a pre-initialised
process), ``pool`` (run directories, runner environments, warm runners), ``_drain``,
``_windows``. Every kernel fact and signal goes through the OS edge both packages share,
``subagent.osedge``.

Imports nothing on purpose: import the module you need.
"""
