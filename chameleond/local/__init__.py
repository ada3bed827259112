"""A whole job on one machine (`chameleonctl up`, `chameleonctl bench recovery`): the local cluster,
fault injection, trace replay, live progress and the recovery report."""
