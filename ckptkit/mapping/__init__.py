"""Names and shapes mapped as data: mapping files (``spec``), their expressions and key
patterns, the tensor ops with their inverses, and the plan that accounts for every source byte."""
