"""The planner: the fastest V-shape schedule it can find under a memory budget.

`generators` holds the four registered V-shape generators (v-min, v-half, v-zb, v-auto);
`search.plan` is the one search they all call; the steps it runs live beside it (problem,
listing, local, justify, slots); `optimal` is the exact reference (CP-SAT, optional);
`choose` and `frontier` pick and list plans across budgets.  It imports the schedule model
(schedule/) and nothing imports it back except the registry, which names its generators.
"""
