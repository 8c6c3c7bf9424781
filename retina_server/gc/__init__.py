"""Storage GC on the node: the commit side of rewrites, its journal and recovery,
the scheduler, lineage and reverts, and the sweepers with their retention guard."""
