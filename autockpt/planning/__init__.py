"""Planning: the pipeline step that turns a walked, measured model into a :class:`~autockpt.plan.Plan`.

``prepare`` walks the model, dry-runs it, profiles it when a budget asks for costs, and
builds the plan (``build_plan``, the only place a Plan is made) by calling one of the
planners; ``budget_costs`` turns a profile into the budget planner's request and its answer
back into the chain's stages. The planners themselves (``autockpt.planners``) are pure,
torch-free functions of stage costs; ``autockpt.plan`` is the data they return.
"""
