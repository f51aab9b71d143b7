"""The GSM8K-with-calculator task: rows in verl's multi-turn layout, its tool config, and its reward."""

from meshrl.data.gsm8k_tools import SYSTEM_PROMPT, calculator_row, write_task
from meshrl.rewards.dispatch import default_compute_score
from meshrl.rollout.tool_parsers import tool_parser
from meshrl.rollout.tools import Invocation, ToolRunner, load_tools


def test_rows_tool_config_and_reward_fit_together(tmp_path):
    import pyarrow.parquet as pq

    written = write_task(tmp_path)
    rows = pq.read_table(written["test"]).to_pylist()
    assert len(rows) == 1319 and rows[0]["data_source"] == "openai/gsm8k"
    assert rows[0]["prompt"][0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert rows[0]["prompt"][1]["role"] == "user" and rows[0]["extra_info"]["agent_name"] == "tool_agent"
    tools = load_tools(written["tool_config"])
    assert [tool.name for tool in tools] == ["calculator"]
    # The call the system prompt shows parses and runs; a conversation ending in the right answer scores 1.
    call = SYSTEM_PROMPT[SYSTEM_PROMPT.index("<tool_call>"):SYSTEM_PROMPT.index("</tool_call>") + 12]
    parsed = tool_parser("hermes").parse(call.replace("<arithmetic expression>", "16 - 3 - 4"))
    runner = ToolRunner(tools, max_response_chars=64)
    try:
        result, = runner.run([Invocation(c.name, c.arguments) for c in parsed.calls])
    finally:
        runner.shutdown()
    assert result.text == "9"
    truth = rows[0]["reward_model"]["ground_truth"]
    assert default_compute_score("openai/gsm8k", f"{call}\ntool\n9\nassistant\n9 * 2 = 18\n#### 18", truth) == 1.0
    assert calculator_row({"prompt": [], "extra_info": {"index": 3}})["extra_info"] == {"index": 3,
                                                                                        "agent_name": "tool_agent"}
