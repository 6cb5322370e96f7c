"""The trainer: Ray driver, learner and rollout actors, metrics. The only part of Mint that imports Ray or DeepSpeed.

`mint.train.driver.train(config)` runs a recipe. The actors live in `learner` and `rollout_actor`, owned by
`learner_group` and `rollout_fleet` (which also owns the engine servers of `engine_servers`); `inner_step` holds the
learner's per-group work (the naive padded step and the LongStraw step) apart from DeepSpeed's setup. docs/layout.md
maps the rest.
"""
