"""Tools around training runs: the sparsity sweep (``sweep``, ``sweep_report``) and Slurm submission
(``sbatch``; its hostlist helpers are :mod:`k2.parallel.hostlist`).
"""
