"""Tools around training runs: the sparsity sweep (``sweep``, ``sweep_report``) and Slurm submission
(``sbatch``, ``hostlist``).
"""
