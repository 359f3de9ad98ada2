"""The paper's experiments: every ablation variant defined once (`variants`), the ablation plans that train
and evaluate them (`ablations`), and the CPU demo that runs all of it in miniature (`demo`). Their commands,
`ablate` and `demo`, are in `cli`."""
