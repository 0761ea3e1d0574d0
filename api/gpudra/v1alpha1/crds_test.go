package v1alpha1

import (
	"bytes"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

// chartCRDs is where the chart keeps its copies of the CRDs.
const chartCRDs = "../../../deployments/helm/gpudra/crds"

type crdCase struct {
	file     string
	typ      reflect.Type
	kind     string
	plural   string
	scope    string
	short    string
	printers []string // column names, in order
}

var crdCases = []crdCase{
	{
		file: "gpudra.dev_gpuqueues.yaml", typ: reflect.TypeFor[GpuQueue](), kind: KindGpuQueue,
		plural: GpuQueues.Resource, scope: "Cluster", short: "gq",
		printers: []string{"Policy", "Waiting", "Head", "Age"},
	},
	{
		file: "gpudra.dev_gpureservations.yaml", typ: reflect.TypeFor[GpuReservation](), kind: KindGpuReservation,
		plural: GpuReservations.Resource, scope: "Namespaced", short: "gres",
		printers: []string{"Phase", "Devices", "Nodes", "Queue", "Position", "Reason", "Expires", "Age"},
	},
}

func loadCRD(t *testing.T, file string) map[string]any {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("crds", file))
	require.NoError(t, err)
	var m map[string]any
	require.NoError(t, yaml.Unmarshal(b, &m), file)
	return m
}

// get walks nested maps (and, for a numeric key, lists).
func get(t *testing.T, m any, keys ...string) any {
	t.Helper()
	cur := m
	for _, k := range keys {
		switch c := cur.(type) {
		case map[string]any:
			v, ok := c[k]
			require.True(t, ok, "missing %q in path %v", k, keys)
			cur = v
		case []any:
			i := 0
			for _, ch := range k {
				i = i*10 + int(ch-'0')
			}
			require.Less(t, i, len(c), "index %s in path %v", k, keys)
			cur = c[i]
		default:
			t.Fatalf("cannot descend into %T at %q (path %v)", cur, k, keys)
		}
	}
	return cur
}

func TestCRDsEmbeddedAndChartCopiesIdentical(t *testing.T) {
	docs, err := CRDs()
	require.NoError(t, err)
	require.Len(t, docs, len(crdCases))
	for i, c := range crdCases { // crdCases is in file-name order, as CRDs() returns
		onDisk, err := os.ReadFile(filepath.Join("crds", c.file))
		require.NoError(t, err)
		assert.True(t, bytes.Equal(onDisk, docs[i]), "CRDs()[%d] is not %s", i, c.file)

		chart, err := os.ReadFile(filepath.Join(chartCRDs, c.file))
		require.NoError(t, err, "the chart must carry a copy of %s", c.file)
		assert.True(t, bytes.Equal(onDisk, chart),
			"%s/%s differs from api/gpudra/v1alpha1/crds/%s: copy it over", chartCRDs, c.file, c.file)
	}
	// No stray CRD in the chart that the code does not embed.
	entries, err := os.ReadDir(chartCRDs)
	require.NoError(t, err)
	var names []string
	for _, e := range entries {
		names = append(names, e.Name())
	}
	want := []string{crdCases[0].file, crdCases[1].file}
	assert.Equal(t, want, names)
}

func TestCRDNames(t *testing.T) {
	for _, c := range crdCases {
		t.Run(c.kind, func(t *testing.T) {
			crd := loadCRD(t, c.file)
			assert.Equal(t, "apiextensions.k8s.io/v1", crd["apiVersion"])
			assert.Equal(t, "CustomResourceDefinition", crd["kind"])
			assert.Equal(t, c.plural+"."+GroupName, get(t, crd, "metadata", "name"))
			assert.Equal(t, GroupName, get(t, crd, "spec", "group"))
			assert.Equal(t, c.scope, get(t, crd, "spec", "scope"))
			assert.Equal(t, c.kind, get(t, crd, "spec", "names", "kind"))
			assert.Equal(t, c.kind+"List", get(t, crd, "spec", "names", "listKind"))
			assert.Equal(t, c.plural, get(t, crd, "spec", "names", "plural"))
			assert.Equal(t, []any{c.short}, get(t, crd, "spec", "names", "shortNames"))
			assert.Equal(t, []any{"gpudra"}, get(t, crd, "spec", "names", "categories"))
			versions := get(t, crd, "spec", "versions").([]any)
			require.Len(t, versions, 1)
			assert.Equal(t, Version, get(t, versions[0], "name"))
			assert.Equal(t, true, get(t, versions[0], "storage"))
			assert.Equal(t, map[string]any{}, get(t, versions[0], "subresources", "status"))
		})
	}
}

var (
	durationType = reflect.TypeFor[metav1.Duration]()
	timeType     = reflect.TypeFor[metav1.Time]()
	objMetaType  = reflect.TypeFor[metav1.ObjectMeta]()
)

type jsonField struct {
	name      string
	omitempty bool
	typ       reflect.Type
}

// jsonFields lists a struct's fields as encoding/json sees them, with
// inline embedded structs (TypeMeta) flattened.
func jsonFields(t reflect.Type) []jsonField {
	var out []jsonField
	for f := range t.Fields() {
		tag := f.Tag.Get("json")
		name, opts, _ := strings.Cut(tag, ",")
		if name == "-" || !f.IsExported() {
			continue
		}
		if f.Anonymous && name == "" && strings.Contains(opts, "inline") {
			out = append(out, jsonFields(f.Type)...)
			continue
		}
		if name == "" {
			name = f.Name
		}
		out = append(out, jsonField{name: name, omitempty: strings.Contains(opts, "omitempty"), typ: f.Type})
	}
	return out
}

// reporter is what compareSchema needs of a *testing.T, so that its own
// test can record failures instead of failing.
type reporter interface {
	Errorf(format string, args ...any)
	Helper()
}

type recorder struct{ failed bool }

func (r *recorder) Errorf(string, ...any) { r.failed = true }
func (r *recorder) Helper()               {}

// compareSchema checks that schema describes t exactly: same properties,
// compatible types and formats, and no required property that Go may omit.
func compareSchema(t reporter, path string, typ reflect.Type, schema map[string]any) {
	t.Helper()
	for typ.Kind() == reflect.Pointer {
		typ = typ.Elem()
	}
	stype, _ := schema["type"].(string)
	format, _ := schema["format"].(string)
	switch {
	case typ == durationType:
		assert.Equal(t, "string", stype, "%s: a duration is a string", path)
	case typ == timeType:
		assert.Equal(t, "string", stype, "%s: a time is a string", path)
		assert.Equal(t, "date-time", format, "%s", path)
	case typ == objMetaType:
		assert.Equal(t, "object", stype, "%s", path)
	case typ.Kind() == reflect.String:
		assert.Equal(t, "string", stype, "%s", path)
	case typ.Kind() == reflect.Bool:
		assert.Equal(t, "boolean", stype, "%s", path)
	case typ.Kind() == reflect.Int32:
		assert.Equal(t, "integer", stype, "%s", path)
		assert.Equal(t, "int32", format, "%s", path)
	case typ.Kind() == reflect.Int64:
		assert.Equal(t, "integer", stype, "%s", path)
		assert.Equal(t, "int64", format, "%s", path)
	case typ.Kind() == reflect.Slice:
		assert.Equal(t, "array", stype, "%s", path)
		items, ok := schema["items"].(map[string]any)
		if assert.True(t, ok, "%s: array without items", path) {
			compareSchema(t, path+"[]", typ.Elem(), items)
		}
	case typ.Kind() == reflect.Map:
		assert.Equal(t, "object", stype, "%s", path)
		assert.Nil(t, schema["properties"], "%s: a map has additionalProperties, not properties", path)
		ap, ok := schema["additionalProperties"].(map[string]any)
		if assert.True(t, ok, "%s: map without additionalProperties", path) {
			compareSchema(t, path+"{}", typ.Elem(), ap)
		}
	case typ.Kind() == reflect.Struct:
		assert.Equal(t, "object", stype, "%s", path)
		props, _ := schema["properties"].(map[string]any)
		fields := jsonFields(typ)
		names := map[string]jsonField{}
		for _, f := range fields {
			names[f.name] = f
			p := path + "." + f.name
			sub, ok := props[f.name].(map[string]any)
			if !assert.True(t, ok, "%s: field of %s missing from the CRD schema", p, typ) {
				continue
			}
			compareSchema(t, p, f.typ, sub)
		}
		for name := range props {
			_, ok := names[name]
			assert.True(t, ok, "%s.%s: in the CRD schema but not in %s", path, name, typ)
		}
		req, _ := schema["required"].([]any)
		for _, r := range req {
			f, ok := names[r.(string)]
			if assert.True(t, ok, "%s: required %q is no field", path, r) {
				assert.False(t, f.omitempty, "%s.%s: required in the schema but omitempty in Go, so a zero value would be refused", path, f.name)
			}
		}
	default:
		t.Errorf("%s: no schema mapping for Go type %s", path, typ)
	}
}

func TestCRDSchemasMatchTypes(t *testing.T) {
	for _, c := range crdCases {
		t.Run(c.kind, func(t *testing.T) {
			crd := loadCRD(t, c.file)
			schema := get(t, crd, "spec", "versions", "0", "schema", "openAPIV3Schema").(map[string]any)
			compareSchema(t, c.kind, c.typ, schema)
		})
	}
}

// The schema test must itself catch drift: a field added to the types or
// the schema alone has to fail it.
func TestCompareSchemaDetectsDrift(t *testing.T) {
	type small struct {
		A string `json:"a"`
		B int32  `json:"b,omitempty"`
	}
	good := map[string]any{"type": "object", "properties": map[string]any{
		"a": map[string]any{"type": "string"},
		"b": map[string]any{"type": "integer", "format": "int32"},
	}}
	compareSchema(t, "small", reflect.TypeFor[small](), good)

	for name, bad := range map[string]map[string]any{
		"missing property": {"type": "object", "properties": map[string]any{
			"a": map[string]any{"type": "string"},
		}},
		"extra property": {"type": "object", "properties": map[string]any{
			"a": map[string]any{"type": "string"},
			"b": map[string]any{"type": "integer", "format": "int32"},
			"c": map[string]any{"type": "string"},
		}},
		"wrong type": {"type": "object", "properties": map[string]any{
			"a": map[string]any{"type": "integer"},
			"b": map[string]any{"type": "integer", "format": "int32"},
		}},
		"required but omitempty": {"type": "object", "required": []any{"b"}, "properties": map[string]any{
			"a": map[string]any{"type": "string"},
			"b": map[string]any{"type": "integer", "format": "int32"},
		}},
	} {
		rec := &recorder{}
		compareSchema(rec, "small", reflect.TypeFor[small](), bad)
		assert.True(t, rec.failed, "compareSchema accepted a schema with a %s", name)
	}
}

// schemaAt follows a printer column's JSONPath (.a.b) through properties.
// Paths under .metadata are checked against ObjectMeta's JSON fields,
// since the CRD schema leaves metadata to the API server.
func schemaAt(root map[string]any, jsonPath string) (map[string]any, bool) {
	parts := strings.Split(strings.TrimPrefix(jsonPath, "."), ".")
	if parts[0] == "metadata" && len(parts) == 2 {
		for _, f := range jsonFields(objMetaType) {
			if f.name == parts[1] {
				if f.typ == timeType {
					return map[string]any{"type": "string", "format": "date-time"}, true
				}
				return map[string]any{"type": "string"}, true
			}
		}
		return nil, false
	}
	cur := root
	for _, p := range parts {
		props, _ := cur["properties"].(map[string]any)
		next, ok := props[p].(map[string]any)
		if !ok {
			return nil, false
		}
		cur = next
	}
	return cur, true
}

func TestCRDPrinterColumns(t *testing.T) {
	for _, c := range crdCases {
		t.Run(c.kind, func(t *testing.T) {
			crd := loadCRD(t, c.file)
			version := get(t, crd, "spec", "versions", "0")
			schema := get(t, version, "schema", "openAPIV3Schema").(map[string]any)
			cols := get(t, version, "additionalPrinterColumns").([]any)
			var names []string
			for _, col := range cols {
				m := col.(map[string]any)
				name, ctype, path := m["name"].(string), m["type"].(string), m["jsonPath"].(string)
				names = append(names, name)
				s, ok := schemaAt(schema, path)
				if !assert.True(t, ok, "column %s: %s is not in the schema", name, path) {
					continue
				}
				switch ctype {
				case "integer":
					assert.Equal(t, "integer", s["type"], "column %s", name)
				case "date":
					assert.Equal(t, "date-time", s["format"], "column %s", name)
				case "string":
					// A list renders as its JSON; anything else as text.
					assert.True(t, slices.Contains([]any{"string", "array"}, s["type"]), "column %s", name)
				default:
					t.Errorf("column %s: unexpected type %s", name, ctype)
				}
			}
			assert.Equal(t, c.printers, names)
		})
	}
}

// The reservation's schema must make spec immutable in the API server too,
// not only in the webhook, and its enums must match the Go constants.
func TestCRDRulesAndEnums(t *testing.T) {
	res := loadCRD(t, "gpudra.dev_gpureservations.yaml")
	schema := get(t, res, "spec", "versions", "0", "schema", "openAPIV3Schema")
	rules := get(t, schema, "properties", "spec", "x-kubernetes-validations").([]any)
	assert.Contains(t, rules, map[string]any{"rule": "self == oldSelf", "message": "spec is immutable; create a new GpuReservation"})
	assert.ElementsMatch(t, []any{"deviceClassName", "ttl"}, get(t, schema, "properties", "spec", "required"))
	assert.Equal(t, []any{"spec"}, get(t, schema, "required"))
	phases := []any{string(ReservationQueued), string(ReservationHeld), string(ReservationConsumed), string(ReservationExpired), string(ReservationFailed)}
	assert.Equal(t, phases, get(t, schema, "properties", "status", "properties", "phase", "enum"))
	for field, lim := range map[string]float64{"claims": MaxReservationClaims, "count": MaxReservationCount} {
		assert.EqualValues(t, 1, get(t, schema, "properties", "spec", "properties", field, "minimum"), field)
		assert.EqualValues(t, lim, get(t, schema, "properties", "spec", "properties", field, "maximum"), field)
	}

	q := loadCRD(t, "gpudra.dev_gpuqueues.yaml")
	qs := get(t, q, "spec", "versions", "0", "schema", "openAPIV3Schema", "properties", "spec", "properties")
	var policies []any
	for _, p := range Policies {
		policies = append(policies, string(p))
	}
	assert.Equal(t, policies, get(t, qs, "policy", "enum"))
	assert.EqualValues(t, 0, get(t, qs, "agingPerMinute", "minimum"))
	assert.EqualValues(t, 1, get(t, qs, "defaultShare", "minimum"))
	assert.EqualValues(t, 1, get(t, qs, "shares", "additionalProperties", "minimum"))
}
