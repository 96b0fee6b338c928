# Multi-query lookup over 2,048 tokens (recall.py): 4 records, each one token standing for a
# (key, value) pair written over a row of 8 tokens, at random rows of a blank table, and 32 queries
# (keys of the table) at the end; the loss and the accuracy are on the queries' answers only.
# Training starts at 128 tokens and doubles the length each time the training answers reach 80%.
# longcontext.py trains this config with three attentions (make longcontext).
#   python train.py config/recall.py
out_dir = "out-recall"
dataset = "recall"
recall_pairs = 4
recall_queries = 32
recall_row = 8
recall_start_len = 128  # batch 32 x 128 tokens, then 16 x 256, ..., 2 x 2,048
recall_grow_at = 0.8
eval_interval = 100
eval_iters = 8  # 8 batches of 2 sequences at full length: 512 answers
log_interval = 50

batch_size = 2
block_size = 2048

n_layer = 2
n_head = 4
n_embd = 64
dropout = 0.0
bias = False

attention_backend = "auto"
segment_lengths = [8, 64, 2048]
dilation_rates = [1, 2, 4]

learning_rate = 3e-3
max_iters = 6000
lr_decay_iters = 6000
warmup_iters = 30
min_lr = 3e-4
beta2 = 0.99
weight_decay = 0.1
max_minutes = 10.0  # the wall-time budget of one run (training steps; evaluations not counted)
num_threads = 1  # one core: the same for every attention
