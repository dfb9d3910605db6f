"""Chat prompts whose answers repeat their input (an edit, a quotation, a rewrite) and one of free prose: the
workloads of benchmarks.speculative."""

from __future__ import annotations

FUNCTION = '''def summarize_orders(orders, tax_rate, discounts):
    """Totals per customer, with tax and each customer's discount applied."""
    totals = {}
    counts = {}
    for order in orders:
        customer = order["customer"]
        amount = order["amount"]
        if amount <= 0:
            continue
        if customer not in totals:
            totals[customer] = 0.0
            counts[customer] = 0
        totals[customer] += amount
        counts[customer] += 1
    report = []
    for customer, total in totals.items():
        discount = discounts.get(customer, 0.0)
        if discount > 0.5:
            discount = 0.5
        discounted = total * (1.0 - discount)
        taxed = discounted * (1.0 + tax_rate)
        average = total / counts[customer]
        line = {
            "customer": customer,
            "orders": counts[customer],
            "total": round(total, 2),
            "discount": round(discount, 2),
            "due": round(taxed, 2),
            "average": round(average, 2),
        }
        report.append(line)
    report.sort(key=lambda line: line["due"], reverse=True)
    grand_total = 0.0
    for line in report:
        grand_total += line["due"]
    largest = report[0]["customer"] if report else None
    smallest = report[-1]["customer"] if report else None
    summary = {
        "customers": len(report),
        "grand_total": round(grand_total, 2),
        "largest": largest,
        "smallest": smallest,
    }
    if grand_total > 10000:
        summary["tier"] = "gold"
    elif grand_total > 1000:
        summary["tier"] = "silver"
    else:
        summary["tier"] = "bronze"
    for line in report:
        share = line["due"] / grand_total if grand_total else 0.0
        line["share"] = round(share, 4)
    return {"summary": summary, "report": report}
'''

PASSAGE = (
    "The lighthouse at Point Avery was built in 1871 from granite quarried on the island itself. Its lamp was "
    "first lit with whale oil, then with kerosene from 1884, and it was finally electrified in 1936, when a "
    "cable was laid across the channel from the mainland. The keepers lived in a cottage at the foot of the "
    "tower with their families, and the children rowed to school in the village whenever the sea allowed. "
    "During the great storm of 1912 the keeper, Margaret Hale, kept the light burning for three nights "
    "without sleep after her husband was injured on the rocks, and no ship was lost on the point that winter. "
    "The light was automated in 1979 and the last keeper left the island the following spring. Today the "
    "cottage is a small museum that opens from May to September, and visitors can climb the ninety-two "
    "steps of the tower to see the original lens, which was made in Paris and weighs nearly two tonnes."
)

PARAGRAPH = (
    "Our team met on Tuesday to discuss the plans for the new office. Everyone agreed that the current space "
    "is too small and that the move should happen before the end of the year. Sarah presented three options "
    "for the new location, and after a long discussion we chose the building near the train station because "
    "it is easy to reach and the rent is reasonable. The next step is to sign the lease and to plan the move "
    "itself, which will take about two weeks. We will share more details at the next meeting."
)

PROMPTS: dict[str, str] = {
    "edit a function": (
        "Rename the variable `totals` to `amounts_by_customer` in this Python function. Reply with the whole "
        f"function and nothing else.\n\n```python\n{FUNCTION}```"
    ),
    "answer from a passage": (
        f"Read the passage and answer by quoting the sentences that answer the question.\n\n{PASSAGE}\n\n"
        "Question: What happened during the great storm of 1912, and what can visitors do today?"
    ),
    "rewrite a paragraph": (
        "Rewrite the following paragraph, keeping every sentence but changing Tuesday to Wednesday.\n\n"
        f"{PARAGRAPH}"
    ),
    "free prose": "Write a short story about a fox who learns to play the violin.",
}
GROUNDED = ("edit a function", "answer from a passage", "rewrite a paragraph")
