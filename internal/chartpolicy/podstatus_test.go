package chartpolicy

import (
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
)

const chartTemplates = "../../deployments/helm/gpudra/templates"

// jsonFields are the JSON names of a struct type's fields, as the API
// server's objects (and so admission's CEL) spell them.
func jsonFields(t reflect.Type) []string {
	var names []string
	for i := range t.NumField() {
		f := t.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "" || name == "-" {
			continue
		}
		names = append(names, name)
	}
	return names
}

// statusComparison finds `object.status.?f == oldObject.status.?g` terms.
var statusComparison = regexp.MustCompile(`object\.status\.\?(\w+)\s*==\s*oldObject\.status\.\?(\w+)`)

// uncompared says which of PodStatus's fields the controller's pod-updates
// policy does not hold unchanged, and which comparisons it makes that are
// wrong (a field compared with another one, or one PodStatus does not
// have): conditions, which it filters by type, excepted.
func uncompared(policy string) (missing, wrong []string) {
	compared := map[string]bool{}
	for _, m := range statusComparison.FindAllStringSubmatch(policy, -1) {
		if m[1] != m[2] {
			wrong = append(wrong, m[0])
			continue
		}
		compared[m[1]] = true
	}
	fields := jsonFields(reflect.TypeFor[corev1.PodStatus]())
	for _, f := range fields {
		if f != "conditions" && !compared[f] {
			missing = append(missing, f)
		}
	}
	for f := range compared {
		if f == "conditions" || !slices.Contains(fields, f) {
			wrong = append(wrong, "object.status.?"+f)
		}
	}
	slices.Sort(wrong)
	return missing, wrong
}

// The controller's pod-updates policy lets gpudra-controller change one
// thing of a pod's status, its own condition: every other PodStatus field,
// generated here from k8s.io/api's type, must be compared with the old
// object's. A Kubernetes upgrade that adds a status field fails this test
// until the policy compares it too.
func TestControllerPolicyComparesEveryPodStatusField(t *testing.T) {
	b, err := os.ReadFile(filepath.Join(chartTemplates, "controller-policy.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	policy := string(b)
	missing, wrong := uncompared(policy)
	for _, f := range missing {
		t.Errorf("controller-policy.yaml: the pod-updates policy does not hold status.%s unchanged: add\n"+
			"      object.status.?%s == oldObject.status.?%s &&", f, f, f)
	}
	for _, w := range wrong {
		t.Errorf("controller-policy.yaml: %s is no comparison of a PodStatus field with itself", w)
	}
	// Conditions: all but gpudra's own are compared.
	conditions := regexp.MustCompile(`object\.status\.\?conditions\.orValue\(\[\]\)\.filter\(c, c\.type != variables\.condition\) ==\s*` +
		`oldObject\.status\.\?conditions\.orValue\(\[\]\)\.filter\(c, c\.type != variables\.condition\)`)
	if !conditions.MatchString(policy) {
		t.Error("controller-policy.yaml: the pod-updates policy no longer compares the other conditions")
	}
}

// The check itself: a policy that misses a field, or compares one field
// with another, is caught, naming it.
func TestUncompared(t *testing.T) {
	var all []string
	for _, f := range jsonFields(reflect.TypeFor[corev1.PodStatus]()) {
		if f != "conditions" {
			all = append(all, "object.status.?"+f+" == oldObject.status.?"+f)
		}
	}
	missing, wrong := uncompared(strings.Join(all, " &&\n"))
	if len(missing) != 0 || len(wrong) != 0 {
		t.Fatalf("every field compared: missing %v, wrong %v", missing, wrong)
	}
	missing, _ = uncompared(strings.Join(all[1:], " && "))
	if want := strings.TrimPrefix(strings.Fields(all[0])[0], "object.status.?"); !reflect.DeepEqual(missing, []string{want}) {
		t.Errorf("first field left out: missing %v, want [%s]", missing, want)
	}
	_, wrong = uncompared(strings.Join(append(all, "object.status.?podIP == oldObject.status.?hostIP", "object.status.?podIPz == oldObject.status.?podIPz"), " && "))
	if want := []string{"object.status.?podIP == oldObject.status.?hostIP", "object.status.?podIPz"}; !reflect.DeepEqual(wrong, want) {
		t.Errorf("wrong comparisons: %v, want %v", wrong, want)
	}
}
