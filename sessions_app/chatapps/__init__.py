"""Chat-app channels (Telegram, Feishu/Lark): see `base` for the interface every platform
implements and the path its messages take."""
