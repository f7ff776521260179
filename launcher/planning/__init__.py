"""Planning a cluster run without a GPU (``k2-plan``'s engine): state and activation memory per GPU
(``memory``), the pipeline bubble and step time of a layout (``analysis``), the ranked layouts of a
cluster (``search``), the plan (``cluster``) and its tables (``report``).
"""
