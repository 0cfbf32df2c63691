"""Prompts for calibration, written for it: input-guided tasks (rewrite, summarise, edit code, answer about a text)
whose answers reuse spans of the prompt (PLD+), short chat questions (SV) and assorted tasks whose answers seed
SPECTRA's retrieval corpus. None is taken from a benchmark set."""

def chat_prompt_ids(tokenizer, texts: tuple[str, ...]) -> list[list[int]]:
    """Each text as the user's turn of a chat, rendered with the model's chat template, ready to answer."""
    return [
        list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"])
        for text in texts
    ]


CALIBRATION_PROMPTS = (
    "Rewrite this note so that it sounds polite, keeping every fact:\n\nThe printer on the third floor is broken "
    "again. Somebody jammed it with thick paper on Monday. Use the one in the kitchen until the technician comes on "
    "Thursday morning. Do not try to fix it yourself, the last person who did that broke the tray.",
    "Summarise the following report in three sentences:\n\nThe town library opened a new reading room in March. "
    "The room has twenty desks, a small stage for readings and a corner with picture books for young children. "
    "Visitors doubled in the first month, mostly on weekday afternoons. The library plans to extend its opening hours "
    "on Saturdays and to hire two more staff members before the summer holidays.",
    "Add type hints and a docstring to this Python function, and return the whole function:\n\n"
    "def average_speed(distances, times):\n    total_distance = sum(distances)\n    total_time = sum(times)\n"
    "    if total_time == 0:\n        return 0\n    return total_distance / total_time\n",
    "Correct the spelling mistakes in this paragraph and return the corrected paragraph:\n\nOur team will meet every "
    "wensday at ten oclock in the big confrence room. Please bring your laptop and the weekly numbers. If you can not "
    "come, send a short messege to the team leader before the meeting starts.",
    "Read the recipe and list the ingredients with their amounts:\n\nMix 200 grams of flour with two eggs and 300 "
    "millilitres of milk. Add a pinch of salt and one spoon of melted butter. Let the batter rest for ten minutes, "
    "then cook thin pancakes in a hot pan, one ladle at a time.",
    "Change every name in this story from Anna to Maria and return the whole story:\n\nAnna walked to the station "
    "early. Anna had packed a small bag with a book and an apple. When the train arrived, Anna found a seat by the "
    "window and watched the fields go by until Anna fell asleep.",
    "Convert this list into a numbered list and keep the wording unchanged:\n\n- check the tyre pressure\n- clean the "
    "windscreen\n- fill the tank\n- test the brakes on a quiet road\n- put the first aid kit in the boot",
    "Rename the variable count to num_items everywhere in this code and return the code:\n\ncount = 0\n"
    "for item in basket:\n    if item.fresh:\n        count += 1\nprint('fresh items:', count)\n"
    "if count > 10:\n    print('too many to carry')\n",
)

# Short chat prompts written for calibrating draft and companion models (`specserve calibrate sv`), with the ones above.
CHAT_PROMPTS = (
    "Why is the sky blue during the day but red at sunset?",
    "Explain in simple words what a computer's memory is used for.",
    "Write a short story about a cat who learns to ride a bicycle.",
    "What are three good habits for staying healthy while working from home?",
    "How does a bicycle stay upright when it is moving?",
    "Give me some tips for learning a new language as an adult.",
    "What is the difference between weather and climate?",
    "Describe how bread rises when it is baked.",
)

# Assorted tasks written for SPECTRA's retrieval corpus (`specserve calibrate corpus`), with the ones above.
CORPUS_PROMPTS = (
    "Write a Python function that returns the largest even number in a list, or None when there is none.",
    "Write a Python class for a bank account with deposit, withdraw and balance methods.",
    "Explain what a Python list comprehension is, with two short examples.",
    "Write a function that counts how many times each word appears in a sentence and returns a dictionary.",
    "A shop sells pens at 3 dollars each. Tom buys 4 pens and pays with a 20 dollar note. How much change does he "
    "get? Explain each step.",
    "A train travels 120 kilometres in 2 hours. How far does it go in 5 hours at the same speed? Show your working.",
    "List five ways to save water at home, one sentence each.",
    "Write a polite email asking a colleague to review a document by Friday.",
    "What are the main differences between a list and a tuple in Python?",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Describe the water cycle in four short steps.",
    "Write a JSON object for a book with a title, an author, a year and a list of two genres.",
)
